// testbox: the one program of the node tier's test image, a handful of subcommands a pod spec can name, so the
// tier's tests need no image built from a distribution. Every subcommand exits 0 on success and 1 with a message on
// stderr otherwise.
//
//	testbox hello TEXT        print TEXT and the pod's hostname, exit
//	testbox sleep SECONDS     sleep (0: forever), exit 0 on SIGTERM
//	testbox serve PORT        answer every HTTP GET with the hostname
//	testbox get URL [TRIES]   GET URL (retrying once a second), print the body
//	testbox cat FILE          print FILE
//	testbox touch FILE        create FILE
//	testbox rm FILE           remove FILE
//	testbox alloc MIB         allocate and touch MIB MiB of memory, then sleep
package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"
)

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "testbox: "+format+"\n", args...)
	os.Exit(1)
}

func arg(i int, what string) string {
	if len(os.Args) <= i {
		fail("%s: missing %s", os.Args[1], what)
	}
	return os.Args[i]
}

func number(i int, what string) int {
	n, err := strconv.Atoi(arg(i, what))
	if err != nil || n < 0 {
		fail("%s: %s must be a non-negative integer, not %q", os.Args[1], what, os.Args[i])
	}
	return n
}

// sleep returns on SIGTERM/SIGINT (PID 1 gets no default handler), or after seconds (0: never).
func sleep(seconds int) {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	var timeout <-chan time.Time
	if seconds > 0 {
		timeout = time.After(time.Duration(seconds) * time.Second)
	}
	select {
	case <-stop:
	case <-timeout:
	}
}

func get(url string, tries int) {
	var err error
	for i := 0; i < tries; i++ {
		if i > 0 {
			time.Sleep(time.Second)
		}
		var response *http.Response
		response, err = http.Get(url)
		if err != nil {
			continue
		}
		body, _ := io.ReadAll(response.Body)
		response.Body.Close()
		if response.StatusCode != http.StatusOK {
			err = fmt.Errorf("status %d", response.StatusCode)
			continue
		}
		fmt.Printf("%s\n", body)
		return
	}
	fail("get %s: %v", url, err)
}

func main() {
	if len(os.Args) < 2 {
		fail("usage: testbox hello|sleep|serve|get|cat|touch|rm|alloc ARGS")
	}
	hostname, _ := os.Hostname()
	switch os.Args[1] {
	case "hello":
		fmt.Printf("%s from %s\n", arg(2, "TEXT"), hostname)
	case "sleep":
		sleep(number(2, "SECONDS"))
	case "serve":
		port := number(2, "PORT")
		http.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, hostname) })
		fail("serve: %v", http.ListenAndServe(fmt.Sprintf(":%d", port), nil))
	case "get":
		tries := 1
		if len(os.Args) > 3 {
			tries = number(3, "TRIES")
		}
		get(arg(2, "URL"), tries)
	case "cat":
		data, err := os.ReadFile(arg(2, "FILE"))
		if err != nil {
			fail("cat: %v", err)
		}
		os.Stdout.Write(data)
	case "touch":
		if err := os.WriteFile(arg(2, "FILE"), nil, 0o644); err != nil {
			fail("touch: %v", err)
		}
	case "rm":
		if err := os.Remove(arg(2, "FILE")); err != nil {
			fail("rm: %v", err)
		}
	case "alloc":
		mib := number(2, "MIB")
		blocks := make([][]byte, 0, mib)
		for i := 0; i < mib; i++ {
			block := make([]byte, 1<<20)
			for j := range block {
				block[j] = 1 // touched, so the pages count against the memory cgroup
			}
			blocks = append(blocks, block)
		}
		fmt.Printf("allocated %d MiB\n", len(blocks))
		sleep(0)
	default:
		fail("unknown subcommand %q", os.Args[1])
	}
}
