"""The fast tier: the Kubernetes API emulator and the fixtures that run the real kopf operator against it."""
