//go:build tools

// Package tools pins actionlint, the linter the tests run over .github/workflows (build.sh builds
// github.com/rhysd/actionlint/cmd/actionlint).
package tools

import _ "github.com/rhysd/actionlint/cmd/actionlint"
