"""The real control plane tier: etcd and kube-apiserver, the clients and faults on it, and Kueue's manager."""
