// The test node's DNS server: CoreDNS with only the plugins a test cluster needs. `kubernetes` answers Service and
// Pod names (the operator's Services are headless, so it alone serves them); there is no `forward`, so any other
// name fails and no query leaves the node.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/hosts"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

// The order of CoreDNS's plugin.cfg for these plugins: it decides the order a query passes through them.
var directives = []string{"bind", "ready", "health", "errors", "log", "cache", "hosts", "kubernetes"}

func init() { dnsserver.Directives = directives }

func main() { coremain.Run() }
