// Command etcd is the single-member etcd the test control plane runs: go.etcd.io/etcd/server/v3's embed package
// behind a handful of flags, so it builds from the Go module proxy alone.
package main

import (
	"flag"
	"log"
	"net/url"
	"os"
	"os/signal"
	"syscall"

	"go.etcd.io/etcd/server/v3/embed"
)

func mustURL(raw string) url.URL {
	u, err := url.Parse(raw)
	if err != nil {
		log.Fatalf("bad URL %q: %v", raw, err)
	}
	return *u
}

func main() {
	dataDir := flag.String("data-dir", "", "data directory (required)")
	clientURL := flag.String("listen-client-urls", "http://127.0.0.1:2379", "client URL")
	peerURL := flag.String("listen-peer-urls", "http://127.0.0.1:2380", "peer URL")
	flag.Parse()
	if *dataDir == "" {
		log.Fatal("--data-dir is required")
	}
	cfg := embed.NewConfig()
	cfg.Dir = *dataDir
	cfg.Name = "test"
	client, peer := mustURL(*clientURL), mustURL(*peerURL)
	cfg.ListenClientUrls = []url.URL{client}
	cfg.AdvertiseClientUrls = []url.URL{client}
	cfg.ListenPeerUrls = []url.URL{peer}
	cfg.AdvertisePeerUrls = []url.URL{peer}
	cfg.InitialCluster = cfg.Name + "=" + peer.String()
	// A test server: no fsync per write (the data dir is thrown away) and a small backend.
	cfg.UnsafeNoFsync = true
	cfg.QuotaBackendBytes = 512 << 20
	cfg.LogLevel = "warn"
	srv, err := embed.StartEtcd(cfg)
	if err != nil {
		log.Fatalf("start etcd: %v", err)
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	select {
	case <-srv.Server.ReadyNotify():
		log.Printf("etcd ready on %s", client.String())
	case err := <-srv.Err():
		log.Fatalf("etcd: %v", err)
	}
	select {
	case <-stop:
	case err := <-srv.Err():
		log.Fatalf("etcd: %v", err)
	}
	srv.Close()
}
