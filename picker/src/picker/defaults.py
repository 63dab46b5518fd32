"""Every default of the picker, in one place: the CLI, the Router, the scraper, the signals
process, the routing lab and the local stack read them from here.

No imports: the lab and the local stack can read these without pulling in aiohttp or gRPC.
"""

# Ports (DESIGN.md "Interfaces").
GRPC_PORT = 9002
HEALTH_PORT = 9003
METRICS_PORT = 9090
OUTCOMES_PORT = 9004   # Envoy's gRPC access log service: the outcome of every routed request

# Scraping. A vLLM engine step (one decode token for the whole batch) takes tens of milliseconds
# to ~100 ms on the target hardware, so 100 ms sees each change within about one step; the
# in-flight counts cover requests sent between scrapes. The upstream picker scrapes every 50 ms
# from Go; from Python that doubles the CPU for little gain (see README, bench).
SCRAPE_INTERVAL = 0.1          # seconds between scrapes of one endpoint (small pools)
# Large pools: the interval grows so the scrapes of the whole pool stay within this rate
# (parsing a page costs ~0.2 ms of CPU: 2,000 pages/s is about half a core in the signals
# process), but never past half the staleness bound, so a healthy endpoint never goes stale.
SCRAPE_RATE_BUDGET = 2000.0    # pages per second per replica
SCRAPE_TIMEOUT_MIN = 0.5       # seconds; the timeout of one scrape is max(this, 5 x interval)
# Readiness: a failed scrape does not take an endpoint out at once (a slow or dropped scrape is
# not a dead endpoint); this many consecutive failures, or metrics older than the staleness
# bound, do.
SCRAPE_FAILURES_TO_UNREADY = 3
# /v1/models (the LoRA adapters an endpoint has loaded, idle ones too) changes only when adapters
# are loaded or unloaded.
MODELS_INTERVAL = 10.0

# Decisions.
STALENESS = 1.0                # seconds; older metrics count as unknown-and-saturated
INFLIGHT_TIMEOUT = 1800.0      # seconds; in-flight entries older than this are dropped
MAX_BODY_BYTES = 8 * 1024 * 1024
# What one replica holds at once; beyond these a request gets 503 with the reason.
MAX_STREAMS = 2048                      # ext_proc streams
# The ext_proc server: "native" (the compiled transport, picker/native/) or "python" (grpc.aio,
# the fallback); both answer alike (README "Protocol").
EXT_PROC_SERVER = "native"
MAX_BUFFERED_BYTES = 128 * 1024 * 1024  # request body bytes, all streams together
AVG_PROMPT_ALPHA = 0.05        # EWMA weight of the running mean prompt size

# Prefix-cache affinity (a profile's `prefix:` section): the picker hashes prompts in blocks of
# this many tokens (vLLM's KV block size), matches at most this many leading blocks, and keeps
# this many blocks per endpoint in its LRU index (about the KV cache of one A10 group).
PREFIX_BLOCK_SIZE_TOKENS = 16
PREFIX_MAX_BLOCKS = 256
PREFIX_LRU_CAPACITY_PER_SERVER = 31250
# Saturation (a profile's `saturation:` section): an endpoint with more waiting requests than
# this, or a KV cache fuller than this, counts as saturated.
SATURATION_QUEUE_DEPTH = 5.0
SATURATION_KV_CACHE_UTIL = 0.8

# Flow control (picker.flowcontrol): requests no endpoint can start now wait in the picker.
# The age bounds must stay below the gateway's ext_proc messageTimeout and the listener's
# requestReceivedTimeout (make validate checks the manifests).
FLOW_CONTROL = False          # the CLI default; base/picker keeps it off (see README, "Flow control")
FLOW_MAX_REQUESTS = 1000       # held at once per worker, all priorities
FLOW_MAX_WAIT = 30.0           # seconds a request of priority >= 0 may wait
FLOW_MAX_WAIT_SHEDDABLE = 5.0  # seconds a sheddable request (priority < 0) may wait
# At the age bound a request of priority >= 0 is sent as without flow control ("dispatch"),
# refused with 503 ("reject"), or sent only while no other band or client is active
# ("dispatch-uncontested"). The lab (tuning seeds): "dispatch" puts competing traffic into the
# engines' FIFO queues, ~45x a light client's TTFT; "reject" fails up to 8 % of a saturated
# closed loop's requests of one client; "dispatch-uncontested" neither.
FLOW_AT_BOUND = "dispatch-uncontested"
FLOW_STRICT_TURNS = 8          # higher-priority dispatches in a row before a lower band's turn
FLOW_MAX_ENGINE_WAITING = 0    # an engine with more requests waiting has no room
FLOW_OUTPUT_RESERVE = 256      # KV tokens kept free per dispatched request beyond its prompt
# An endpoint without room stays a candidate when its prefix cache holds at least this many more
# of the prompt's tokens than any endpoint with room (prefix affinity beats an empty slot).
FLOW_AFFINITY_TOKENS = 1024
# Holdback: a request that must leave room for others (a lower band while a higher one arrived in
# the last FLOW_ACTIVITY_WINDOW seconds, or a client over its share of its band's arrivals in that
# window, while the pool is saturated: see flowcontrol/controller.py) needs this fraction of an
# endpoint's KV capacity free beyond its own need.
FLOW_HOLDBACK = 0.3
FLOW_ACTIVITY_WINDOW = 120.0
# Seconds beyond the staleness bound that requests are held while every candidate's metrics are
# stale: a stalled scraper or worker gets fresh signals back well within it, and the queue is not
# dumped into the engines meanwhile; longer, the signals are lost and nothing is held.
FLOW_STALE_HOLD = 5.0

# Candidate prefilter for large pools: above PREFILTER_ABOVE candidates, only the endpoints
# holding the longest prefix match plus PREFILTER_SAMPLE endpoints sampled at random (the
# power-of-d idea) and the PREFILTER_LEAST least-loaded are scored in full.
PREFILTER_ABOVE = 32
PREFILTER_SAMPLE = 8
PREFILTER_LEAST = 4
PREFILTER_OWNERS = 8           # at most this many prefix holders are kept

# KV-cache events (precise prefix routing; signals/kvstate.py, kvsubscriber.py).
KV_EVENTS_PORT = 5557          # each leader's ZMQ publisher (DESIGN.md; vLLM's example ports)
KV_REPLAY_PORT = 5558          # its replay (ROUTER) socket
KV_DEFAULT_MAX_BLOCKS = 65536  # blocks tracked per endpoint until its num_gpu_blocks is scraped
KV_MAX_BLOCKS_PER_ENDPOINT = 1 << 20  # ceiling even if an endpoint reports more capacity
KV_MAX_PENDING = 1000          # live messages held per endpoint while a replay runs
KV_MAX_MESSAGE_BYTES = 16 << 20  # larger ZMQ messages are refused by the socket itself
# A busy engine publishes tens of KB/s (a few bytes per prompt token); 4 MiB/s per endpoint is
# ~100x that, and keeps a flooding publisher from taking the signals process's CPU.
KV_MAX_BYTES_PER_SECOND = 4 * 1024 * 1024
KV_REPLAY_TIMEOUT = 2.0        # seconds for the replay socket's whole answer
KV_RESYNC_BACKOFF = 5.0        # seconds before an out-of-sync endpoint asks for a replay again
# Silence: the engine's metrics show at least this many full blocks of prompt computed, and
# no batch arrived for KV_SILENCE_SECONDS: the publisher is silent, the endpoint falls back.
KV_SILENT_BLOCKS = 8
KV_SILENCE_SECONDS = 5.0
KV_ASSUMED_BLOCK_SIZE = 16     # block size before an event or the metrics tell it
KV_FLUSH_INTERVAL = 0.01       # seconds: index changes reach the workers within this
KV_STATUS_INTERVAL = 1.0       # seconds between per-endpoint status updates (metrics)
# Tokenizer check (scheduling/precise.py): a routed request's first block should appear in its
# endpoint's events once prefilled; this many in a row not seen within the window (generous:
# queueing under load) mean the picker's tokenizer is not the engine's.
KV_VERIFY_WINDOW = 120.0
KV_VERIFY_MISSES = 32
KV_VERIFY_PENDING = 1024       # checks remembered at most
# In-flight (speculative) entries (scheduling/kvindex.py): a request routed to an endpoint in sync
# counts as held there, block by block, until its engine's events confirm them or this many
# seconds pass. Longer than event delivery (P99 ~14 ms + 10 ms flush to the workers) plus a long
# prompt's queueing and prefill under load (the lab's cache-pressure scenarios reach ~10 s mean
# TTFT); short enough that a request the engine sheds or preempts before storing its blocks
# stops attracting its tenant's burst soon after.
KV_INFLIGHT_TTL = 10.0
KV_INFLIGHT_MAX_BLOCKS = 1 << 18   # in-flight (block, endpoint) entries at most, oldest dropped
PRECISE_PREFIX = True          # --precise-prefix: on unless turned off (needs --tokenizer)

# Process model.
WORKERS = 1                    # ext_proc worker processes behind the one gRPC port
PEER_SYNC_INTERVAL = 0.02      # seconds: Redis exchange between replicas; full-table resend to workers
# End each ext_proc stream once answered (the deployed policy sends the request phase only):
# a replica that dies then fails only the requests it was deciding or holding
END_ANSWERED_STREAMS = True
PEER_PORT = 9005               # the replicas' direct link (peer_link.py)
# seconds a stopping replica still answers what Envoy sends after it reports NOT_SERVING (Envoy
# sees that at its next health check: base/gateway checks every 100 ms with a 250 ms timeout)
DRAIN_SECONDS = 1.0
REAP_EVERY = 10.0              # seconds between sweeps for lost in-flight requests
READINESS_EVERY = 0.2          # seconds between readiness checks


def scrape_interval_for(endpoints: int, interval: float = SCRAPE_INTERVAL,
                        staleness: float = STALENESS) -> float:
    """The scrape interval for a pool of `endpoints`: `interval`, grown to keep the pool's
    scrape rate within SCRAPE_RATE_BUDGET, capped at half the staleness bound."""
    needed = endpoints / SCRAPE_RATE_BUDGET
    return max(interval, min(needed, staleness / 2))


def scrape_timeout_for(interval: float) -> float:
    return max(SCRAPE_TIMEOUT_MIN, 5 * interval)
