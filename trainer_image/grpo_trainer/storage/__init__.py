"""Files that outlive a pod: the inputs a pod loads (`s3://` models and datasets downloaded once), the trained
model exported whole with its manifest, again from a checkpoint if need be, and folders in an S3-compatible object
store."""
