// loadclient drives the picker's ext_proc server the way Envoy does, from a separate (cheap,
// compiled) process, so a benchmark on a small machine measures the server and not its client.
//
// Each request is one bidirectional Process stream: request_headers (with protocol_config),
// request_body (end_of_stream; with -chunk N, the body in messages of at most N bytes, as Envoy
// streams a long prompt in full-duplex mode), wait for the routing answer, then response_headers
// (end_of_stream) unless -response-phase=false (the deployed EnvoyExtensionPolicy sends only the
// request phase), close. Closed loop: -streams workers send requests back to back for -seconds;
// open loop (-rate): a new stream every 1/rate s, each held open -hold for its response phase.
// Bodies come from -bodies (one JSON request body per line) so the Python benchmark and this
// client send the same requests. Prints one JSON object with the results.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"sync"
	"syscall"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	pmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extproc "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

type result struct {
	Requests       int     `json:"requests"`
	Errors         int     `json:"errors"`
	WallSeconds    float64 `json:"wall_s"`
	DecisionsPerS  float64 `json:"decisions_per_s"`
	P50Ms          float64 `json:"p50_ms"`
	P99Ms          float64 `json:"p99_ms"`
	ClientCPUMsPer float64 `json:"client_cpu_ms_per_request"`
	FirstError     string  `json:"first_error,omitempty"`
}

func readBodies(path string) ([][]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out [][]byte
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 1<<20), 64<<20)
	for sc.Scan() {
		if len(sc.Bytes()) > 0 {
			out = append(out, append([]byte(nil), sc.Bytes()...))
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s: no bodies", path)
	}
	return out, sc.Err()
}

func headersMsg(mode pmv3.ProcessingMode_BodySendMode) *extproc.ProcessingRequest {
	hv := func(k, v string) *corev3.HeaderValue { return &corev3.HeaderValue{Key: k, RawValue: []byte(v)} }
	return &extproc.ProcessingRequest{
		Request: &extproc.ProcessingRequest_RequestHeaders{RequestHeaders: &extproc.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
				hv(":method", "POST"), hv(":path", "/v1/completions"), hv("content-type", "application/json")}},
		}},
		ProtocolConfig: &extproc.ProtocolConfiguration{RequestBodyMode: mode},
	}
}

// oneRequest returns the time from opening the stream to receiving the routing answer (what
// Envoy waits before it can pick the upstream); hold is how long the response phase is delayed.
func oneRequest(ctx context.Context, client extproc.ExternalProcessorClient, head *extproc.ProcessingRequest,
	body []*extproc.ProcessingRequest, fullDuplex, responsePhase bool, hold time.Duration) (time.Duration, error) {
	t0 := time.Now()
	stream, err := client.Process(ctx)
	if err != nil {
		return 0, err
	}
	if err := stream.Send(head); err != nil {
		return 0, err
	}
	if !fullDuplex { // BUFFERED: the headers message is answered at once
		r, err := stream.Recv()
		if err != nil {
			return 0, err
		}
		if r.GetRequestHeaders() == nil {
			return 0, fmt.Errorf("expected a headers answer, got %v", r)
		}
	}
	for _, msg := range body {
		if err := stream.Send(msg); err != nil {
			return 0, err
		}
	}
	r, err := stream.Recv()
	if err != nil {
		return 0, err
	}
	lat := time.Since(t0)
	var routed bool
	if fullDuplex {
		routed = r.GetRequestHeaders() != nil
		for routed { // the echoed body, up to its last chunk
			b, err := stream.Recv()
			if err != nil {
				return 0, err
			}
			if b.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetEndOfStream() {
				break
			}
		}
	} else {
		routed = r.GetRequestBody() != nil
	}
	if !routed {
		return 0, fmt.Errorf("not routed: %v", r)
	}
	if hold > 0 {
		time.Sleep(hold)
	}
	if responsePhase {
		resp := &extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_ResponseHeaders{
			ResponseHeaders: &extproc.HttpHeaders{EndOfStream: true}}}
		if err := stream.Send(resp); err != nil {
			return 0, err
		}
		if _, err := stream.Recv(); err != nil {
			return 0, err
		}
	}
	if err := stream.CloseSend(); err != nil {
		return 0, err
	}
	if _, err := stream.Recv(); err != io.EOF {
		return 0, fmt.Errorf("expected the stream to end, got %v", err)
	}
	return lat, nil
}

func cpuSeconds() float64 {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	tv := func(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }
	return tv(ru.Utime) + tv(ru.Stime)
}

func main() {
	addr := flag.String("addr", "127.0.0.1:9002", "ext_proc server (plaintext)")
	streams := flag.Int("streams", 64, "concurrent streams")
	seconds := flag.Float64("seconds", 5, "run time")
	warmup := flag.Float64("warmup", 1, "seconds of unmeasured warm-up first")
	bodiesPath := flag.String("bodies", "", "file with one request body per line")
	mode := flag.String("mode", "buffered", "request body mode: buffered or full-duplex")
	rate := flag.Float64("rate", 0, "open loop: start this many requests per second (0: closed loop)")
	hold := flag.Duration("hold", 0, "open loop: time each stream stays open after its routing answer")
	conns := flag.Int("conns", 1, "gRPC connections, streams spread round robin (Envoy opens one per worker thread)")
	responsePhase := flag.Bool("response-phase", true, "send response_headers before closing (false: request phase only)")
	chunk := flag.Int("chunk", 0, "full-duplex: send each body in messages of at most this many bytes (0: one message)")
	flag.Parse()
	bodies, err := readBodies(*bodiesPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	fullDuplex := *mode == "full-duplex"
	bodyMode := pmv3.ProcessingMode_BUFFERED
	if fullDuplex {
		bodyMode = pmv3.ProcessingMode_FULL_DUPLEX_STREAMED
	} else if *mode != "buffered" {
		fmt.Fprintln(os.Stderr, "-mode must be buffered or full-duplex")
		os.Exit(2)
	}
	head := headersMsg(bodyMode)
	bodyMsgs := make([][]*extproc.ProcessingRequest, len(bodies))
	for i, b := range bodies {
		size := len(b)
		if *chunk > 0 && fullDuplex {
			size = *chunk
		}
		for at := 0; at < len(b) || at == 0; at += size {
			end := min(at+size, len(b))
			bodyMsgs[i] = append(bodyMsgs[i], &extproc.ProcessingRequest{Request: &extproc.ProcessingRequest_RequestBody{
				RequestBody: &extproc.HttpBody{Body: b[at:end], EndOfStream: end == len(b)}}})
			if end == len(b) {
				break
			}
		}
	}
	if *conns < 1 {
		fmt.Fprintln(os.Stderr, "-conns must be at least 1")
		os.Exit(2)
	}
	clients := make([]extproc.ExternalProcessorClient, *conns)
	for i := range clients {
		// One channel each, so each is its own TCP connection (a server with SO_REUSEPORT
		// workers gets them spread over its processes).
		conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20), grpc.MaxCallSendMsgSize(64<<20)))
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		defer conn.Close()
		clients[i] = extproc.NewExternalProcessorClient(conn)
	}
	ctx := context.Background()

	run := func(d time.Duration) (result, []time.Duration) {
		var mu sync.Mutex
		var lats []time.Duration
		res := result{}
		deadline := time.Now().Add(d)
		cpu0, t0 := cpuSeconds(), time.Now()
		var wg sync.WaitGroup
		record := func(lat time.Duration, err error) {
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				res.Errors++
				if res.FirstError == "" {
					res.FirstError = err.Error()
				}
				return
			}
			lats = append(lats, lat)
		}
		if *rate > 0 { // open loop: a new stream every 1/rate s, whatever the server's pace
			interval := time.Duration(float64(time.Second) / *rate)
			for i := 0; time.Now().Before(deadline); i++ {
				if wait := time.Until(t0.Add(time.Duration(i) * interval)); wait > 0 {
					time.Sleep(wait)
				}
				wg.Add(1)
				go func(i int) {
					defer wg.Done()
					record(oneRequest(ctx, clients[i%len(clients)], head, bodyMsgs[i%len(bodyMsgs)], fullDuplex, *responsePhase, *hold))
				}(i)
			}
			wg.Wait() // until the last stream ends: a server that falls behind shows a lower rate
			res.WallSeconds = time.Since(t0).Seconds()
			res.Requests = len(lats)
			if res.Requests > 0 {
				res.ClientCPUMsPer = 1000 * (cpuSeconds() - cpu0) / float64(res.Requests)
			}
			return res, lats
		}
		for w := 0; w < *streams; w++ {
			wg.Add(1)
			go func(w int) {
				defer wg.Done()
				client := clients[w%len(clients)]
				mine := make([]time.Duration, 0, 1024)
				errs, first := 0, ""
				for i := w; time.Now().Before(deadline); i += *streams {
					lat, err := oneRequest(ctx, client, head, bodyMsgs[i%len(bodyMsgs)], fullDuplex, *responsePhase, 0)
					if err != nil {
						errs++
						if first == "" {
							first = err.Error()
						}
						continue
					}
					mine = append(mine, lat)
				}
				mu.Lock()
				lats = append(lats, mine...)
				res.Errors += errs
				if res.FirstError == "" {
					res.FirstError = first
				}
				mu.Unlock()
			}(w)
		}
		wg.Wait()
		res.WallSeconds = time.Since(t0).Seconds()
		res.Requests = len(lats)
		if res.Requests > 0 {
			res.ClientCPUMsPer = 1000 * (cpuSeconds() - cpu0) / float64(res.Requests)
		}
		return res, lats
	}
	if *warmup > 0 {
		run(time.Duration(*warmup * float64(time.Second)))
	}
	res, lats := run(time.Duration(*seconds * float64(time.Second)))
	sort.Slice(lats, func(i, j int) bool { return lats[i] < lats[j] })
	pct := func(q float64) float64 {
		if len(lats) == 0 {
			return 0
		}
		i := int(q * float64(len(lats)))
		if i >= len(lats) {
			i = len(lats) - 1
		}
		return float64(lats[i].Microseconds()) / 1000
	}
	res.DecisionsPerS = float64(res.Requests) / res.WallSeconds
	res.P50Ms, res.P99Ms = pct(0.5), pct(0.99)
	json.NewEncoder(os.Stdout).Encode(res)
}
