"""The rollout server's pod: the entrypoint that runs vLLM's OpenAI server for the run (`main`) and the health
that proves it generates (`health`). Runs in the vLLM image or venv: nothing here imports torch or trl."""
