// Command driver runs DTM's equivalent of the alpha-benchmark saga against a
// running DTM server and prints one line `RESULT {json}`.
//
// Each of --concurrency workers submits sagas one after another until
// --transactions were submitted. A saga has --branches branches (default 3,
// the three services of alpha-benchmark); every action and compensation is an
// empty HTTP handler served by this driver on loopback. A share
// --abort-ratio of the sagas fails in its last branch, so DTM compensates it.
// Sagas are submitted with WaitResult, so Submit returns when DTM has driven
// the saga to its final state (succeeded, or failed after compensation), or
// when DTM's own wait ran out; a saga whose submit did not answer success is
// queried until its state is final or --settle-timeout (from its submit)
// passes. Its latency runs to that moment; one that ends anywhere but in its
// expected final state counts as lost.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dtm-labs/client/dtmcli"
)

type options struct {
	dtm           string
	transactions  int
	concurrency   int
	branches      int
	abortRatio    float64
	settleTimeout time.Duration
	store         string
	version       string
}

// counters are bumped by the branch handlers, which DTM calls.
type counters struct {
	actions       atomic.Int64
	failures      atomic.Int64
	compensations atomic.Int64
}

type outcome struct {
	latency time.Duration
	abort   bool
	final   string // "succeed", "failed", or "" when unknown after submit
	err     string
}

func main() {
	var o options
	flag.StringVar(&o.dtm, "dtm", "http://127.0.0.1:36789/api/dtmsvr", "DTM server's HTTP API base URL")
	flag.IntVar(&o.transactions, "transactions", 50000, "global transactions to run")
	flag.IntVar(&o.concurrency, "concurrency", 500, "sagas in flight at once (one worker each)")
	flag.IntVar(&o.branches, "branches", 3, "branches per saga (action + compensation each)")
	flag.Float64Var(&o.abortRatio, "abort-ratio", 0, "share of sagas whose last branch fails, 0..1")
	flag.DurationVar(&o.settleTimeout, "settle-timeout", 60*time.Second, "bound on waiting for one saga to reach its final state, from its submit")
	flag.StringVar(&o.store, "store", "", "the DTM store driver under test, echoed in RESULT")
	flag.StringVar(&o.version, "version", "", "the DTM release under test, echoed in RESULT")
	flag.Parse()
	if err := o.check(); err != nil {
		fmt.Fprintf(os.Stderr, "driver: %v\n", err)
		os.Exit(2)
	}
	if err := run(o); err != nil {
		fmt.Fprintf(os.Stderr, "driver: %v\n", err)
		os.Exit(1)
	}
}

func (o *options) check() error {
	switch {
	case o.transactions < 1:
		return errors.New("--transactions must be at least 1")
	case o.concurrency < 1:
		return errors.New("--concurrency must be at least 1")
	case o.branches < 1:
		return errors.New("--branches must be at least 1")
	case o.abortRatio < 0 || o.abortRatio > 1:
		return errors.New("--abort-ratio must be within 0..1")
	}
	return nil
}

// aborts says whether saga i fails: spread evenly, floor((i+1)r) > floor(ir).
func aborts(i int, r float64) bool {
	return int(float64(i+1)*r) > int(float64(i)*r)
}

func serveBranches(c *counters) (string, func(), error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	mux := http.NewServeMux()
	success := []byte(`{"dtm_result":"SUCCESS"}`)
	failure := []byte(`{"dtm_result":"FAILURE"}`)
	mux.HandleFunc("/action", func(w http.ResponseWriter, r *http.Request) {
		c.actions.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(success)
	})
	// DTM's HTTP branch protocol: status 409 with FAILURE means the action
	// failed for good and the saga must be compensated.
	mux.HandleFunc("/fail", func(w http.ResponseWriter, r *http.Request) {
		c.failures.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusConflict)
		_, _ = w.Write(failure)
	})
	mux.HandleFunc("/compensate", func(w http.ResponseWriter, r *http.Request) {
		c.compensations.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(success)
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return "http://" + ln.Addr().String(), func() { _ = srv.Close() }, nil
}

func run(o options) error {
	var c counters
	base, stop, err := serveBranches(&c)
	if err != nil {
		return fmt.Errorf("listening for branch calls: %w", err)
	}
	defer stop()

	// Keep one idle connection per worker to DTM (resty's default keeps
	// GOMAXPROCS+1, which would make every worker reconnect per saga).
	dtmcli.GetRestyClient().SetTransport(&http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        o.concurrency * 2,
		MaxIdleConnsPerHost: o.concurrency * 2,
		IdleConnTimeout:     90 * time.Second,
	})

	run := fmt.Sprintf("%x", time.Now().UnixNano())
	outcomes := make([]outcome, o.transactions)
	var next atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < o.concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= o.transactions {
					return
				}
				abort := aborts(i, o.abortRatio)
				saga := dtmcli.NewSaga(o.dtm, fmt.Sprintf("ry-%s-%d", run, i))
				for b := 0; b < o.branches; b++ {
					action := base + "/action"
					if abort && b == o.branches-1 {
						action = base + "/fail"
					}
					saga.Add(action, base+"/compensate", nil)
				}
				saga.WaitResult = true
				t0 := time.Now()
				err := saga.Submit()
				out := outcome{latency: time.Since(t0), abort: abort}
				if err == nil {
					// WaitResult: a nil answer means DTM drove it to succeed.
					out.final = "succeed"
				} else {
					// FAILURE comes both when the saga failed after its
					// compensations and when DTM's wait (RequestTimeout+2 s)
					// ran out while it is still running: ask DTM until the
					// state is final.
					out.err = err.Error()
					out.final = settle(o.dtm, saga.Gid, t0.Add(o.settleTimeout))
					out.latency = time.Since(t0)
				}
				outcomes[i] = out
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)

	var lats []time.Duration
	var committed, compensated, lost, errs int
	firstErr := ""
	for _, out := range outcomes {
		// An error answer for a saga that then reached its expected final
		// state is DTM's normal answer (an abort, or a slow saga); count only
		// the others.
		expected := (!out.abort && out.final == "succeed") || (out.abort && out.final == "failed")
		if out.err != "" && !expected {
			errs++
			if firstErr == "" {
				firstErr = out.err
			}
		}
		switch {
		case !out.abort && out.final == "succeed":
			committed++
			lats = append(lats, out.latency)
		case out.abort && out.final == "failed":
			compensated++
			lats = append(lats, out.latency)
		default:
			lost++
		}
	}
	sort.Slice(lats, func(a, b int) bool { return lats[a] < lats[b] })
	pct := func(p float64) float64 {
		if len(lats) == 0 {
			return 0
		}
		k := int(p*float64(len(lats))+0.999999) - 1
		if k < 0 {
			k = 0
		}
		if k >= len(lats) {
			k = len(lats) - 1
		}
		return float64(lats[k].Microseconds()) / 1000
	}
	var sum time.Duration
	for _, l := range lats {
		sum += l
	}
	mean := 0.0
	if len(lats) > 0 {
		mean = float64(sum.Microseconds()) / 1000 / float64(len(lats))
	}
	result := map[string]any{
		"scenario":             "saga",
		"system":               "dtm",
		"version":              o.version,
		"protocol":             "http",
		"store":                o.store,
		"transactions":         o.transactions,
		"concurrency":          o.concurrency,
		"branches":             o.branches,
		"abort_ratio":          o.abortRatio,
		"elapsed_s":            elapsed.Seconds(),
		"tx_per_s":             float64(committed+compensated) / elapsed.Seconds(),
		"branch_calls_per_s":   float64(c.actions.Load()+c.failures.Load()+c.compensations.Load()) / elapsed.Seconds(),
		"latency_ms":           map[string]float64{"p50": pct(0.50), "p99": pct(0.99), "p999": pct(0.999), "max": pct(1), "mean": mean},
		"committed":            committed,
		"compensated":          compensated,
		"lost":                 lost,
		"errors":               errs,
		"first_error":          firstErr,
		"branch_actions":       c.actions.Load(),
		"branch_failures":      c.failures.Load(),
		"branch_compensations": c.compensations.Load(),
	}
	line, err := json.Marshal(result)
	if err != nil {
		return err
	}
	fmt.Printf("RESULT %s\n", line)
	return nil
}

// settle polls DTM until gid's state is final (succeed or failed), or until
// deadline; it returns the final state, or "" if none was reached.
func settle(dtm, gid string, deadline time.Time) string {
	for {
		st, err := query(dtm, gid)
		if err == nil && (st == "succeed" || st == "failed") {
			return st
		}
		if time.Now().After(deadline) {
			return ""
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// query asks DTM for a global transaction's status.
func query(dtm, gid string) (string, error) {
	var body struct {
		Transaction *struct {
			Status string `json:"status"`
		} `json:"transaction"`
	}
	resp, err := dtmcli.GetRestyClient().R().SetQueryParam("gid", gid).SetResult(&body).Get(dtm + "/query")
	if err != nil {
		return "", err
	}
	if resp.StatusCode() != http.StatusOK || body.Transaction == nil {
		return "", fmt.Errorf("query %s: HTTP %d", gid, resp.StatusCode())
	}
	return body.Transaction.Status, nil
}
