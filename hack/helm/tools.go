//go:build tools

// The helm command is this module's one import: `go build helm.sh/helm/v4/cmd/helm` builds it at the version
// go.mod pins.
package tools

import _ "helm.sh/helm/v4/cmd/helm"
