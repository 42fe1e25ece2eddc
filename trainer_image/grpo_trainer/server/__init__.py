"""The rollout server's pod: the entrypoint that runs vLLM's OpenAI server for the run (`main`), the gate in it that
refuses a request naming a newer weight version than the server holds (`version_gate`), and the health that proves it
generates (`health`). Runs in the vLLM image or venv: nothing here imports torch or trl."""
