"""The local adapter: a GRPORun as processes on this machine (`grporun local`), run by the engine's pass like a
run in a cluster. plan.py is pure (manifest -> processes), processes.py starts, stops and reads them, supervise.py is
the run's port and loop, kubelet.py the kubelet's part (liveness, in-place restarts), scaling.py the run folder's
scale requests and bounds, console.py what is printed. The command line (argument parsing) is cli/local."""
