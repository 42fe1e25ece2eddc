"""The real node tier: kubelet, containerd and runc, the images it runs, the chart on it, and runs driven by kubectl."""
