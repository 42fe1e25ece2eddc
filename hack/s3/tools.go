//go:build tools

// Package tools pins the SeaweedFS server the tests' S3 endpoint runs (build.sh builds github.com/seaweedfs/seaweedfs/weed).
package tools

import _ "github.com/seaweedfs/seaweedfs/weed"
