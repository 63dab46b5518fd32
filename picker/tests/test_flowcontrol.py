"""Flow control: the queue's order and bounds, the controller on a real Router with an injected
clock, and the ext_proc server holding a stream until an endpoint has room."""
from __future__ import annotations

import asyncio

import pytest

from picker.core import RequestInfo
from picker.discovery.objects import Objective
from picker.errors import PickerError
from picker.flowcontrol.controller import FlowControl, FlowSettings
from picker.flowcontrol.queue import FlowQueue, Held, QueueLimits
from picker.flowcontrol.room import RoomRule
from picker.observability.metrics import PickerMetrics
from picker.protocol.server import start_servers

from tests.helpers import extproc_client as c
from helpers import FakeClock, body, make_router, metrics_text

OBJECTIVES = [Objective("interactive", 10), Objective("batch", -10)]


def order(q: FlowQueue) -> list:
    out = []
    while (h := q.peek()) is not None:
        q.pop(h)
        out.append(h.payload)
    return out


# ---- the queue --------------------------------------------------------------------------------

def test_higher_priority_first_fifo_within_a_band():
    q = FlowQueue(QueueLimits(strict_turns=100))
    for i, p in enumerate([0, 10, 0, 10, -10]):
        q.push(p, "", float(i), f"p{p}-{i}")
    assert order(q) == ["p10-1", "p10-3", "p0-0", "p0-2", "p-10-4"]


def test_clients_take_turns_within_a_band():
    q = FlowQueue()
    for i in range(10):
        q.push(0, "heavy", float(i), f"h{i}")
    q.push(0, "light", 10.0, "l0")
    q.push(0, "light", 11.0, "l1")
    got = order(q)
    # the light client's first request goes second, not eleventh
    assert got[:4] == ["h0", "l0", "h1", "l1"]
    assert got[4:] == [f"h{i}" for i in range(2, 10)]


def test_lower_band_gets_a_turn_after_strict_turns():
    q = FlowQueue(QueueLimits(strict_turns=3))
    q.push(0, "", 0.0, "low")
    for i in range(10):
        q.push(10, "", 1.0 + i, f"hi{i}")
    got = order(q)
    assert got.index("low") == 3  # after exactly 3 higher-band dispatches


def test_age_bounds_per_priority_and_next_deadline():
    q = FlowQueue(QueueLimits(max_wait=30.0, max_wait_sheddable=5.0))
    q.push(0, "", 0.0, "normal")
    q.push(-10, "", 1.0, "sheddable")
    assert q.next_deadline() == 6.0
    assert [h.payload for h in q.expired(5.9)] == []
    assert [h.payload for h in q.expired(6.0)] == ["sheddable"]
    assert [h.payload for h in q.expired(30.0)] == ["normal"]
    assert len(q) == 0 and q.next_deadline() is None


def test_full_queue_evicts_the_newest_of_the_lowest_band_or_refuses():
    q = FlowQueue(QueueLimits(max_requests=3))
    q.push(-10, "", 0.0, "batch-old")
    q.push(-10, "", 1.0, "batch-new")
    q.push(0, "", 2.0, "normal")
    held, evicted = q.push(10, "", 3.0, "interactive")
    assert held is not None and evicted.payload == "batch-new"
    held, evicted = q.push(-10, "", 4.0, "batch-late")  # not above the lowest band: refused
    assert held is None and evicted is None
    assert order(q) == ["interactive", "normal", "batch-old"]


def test_removed_request_leaves_at_once():
    q = FlowQueue()
    a, _ = q.push(0, "x", 0.0, "a")
    b, _ = q.push(0, "x", 1.0, "b")
    q.remove(a)
    q.remove(a)  # twice is harmless
    assert len(q) == 1 and q.peek() is b and q.sizes() == {0: 1}


# ---- the controller on a real Router ----------------------------------------------------------

def flow_router(waiting=1, kv=0.5, running=0, at_bound="reject", clock=None, **limits):
    clock = clock or FakeClock()
    metrics = PickerMetrics()
    router = make_router(profile="default", n=2, clock=clock, objectives=OBJECTIVES,
                         metrics=metrics, waiting=waiting, kv=kv, running=running)
    flow = FlowControl(router, FlowSettings(QueueLimits(**limits), RoomRule(),
                                            at_bound=at_bound))
    return router, flow, clock, metrics


def info(prompt="hello", objective=None, client=None):
    headers = {"content-type": "application/json"}
    if objective:
        headers["x-gateway-inference-objective"] = objective
    if client:
        headers["x-client-id"] = client
    return RequestInfo("/v1/completions", headers, body(prompt=prompt))


def big(label: str) -> str:
    """A ~7,000-token prompt (4 characters a token): flow_router's endpoints (64,000 KV tokens)
    at kv 0.75 have room for two of them each, none beyond the 0.3 reserve."""
    return f"{label} " + "w" * 28_000


def scrape_all(router, clock, **load):
    for addr in router.endpoints:
        router.on_scrape_ok(addr, metrics_text(**load), clock())


def sample(metrics, name, **labels):
    value = metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def test_room_decides_at_once_and_no_room_holds_until_a_scrape_shows_room():
    router, flow, clock, metrics = flow_router(waiting=0)
    outcomes = []
    d = flow.submit(info(), outcomes.append)
    assert not isinstance(d, Held) and d.endpoint in router.endpoints
    scrape_all(router, clock, waiting=2)  # every engine has a queue: no room
    held = flow.submit(info(), outcomes.append)
    assert isinstance(held, Held) and outcomes == []
    assert flow.pump() == 0 and outcomes == []
    clock.t += 1.0
    router.on_scrape_ok("10.0.0.2:8000", metrics_text(waiting=0), clock())
    assert flow.pump() == 1
    assert outcomes[0].endpoint == "10.0.0.2:8000"  # the one endpoint with room
    assert metrics.registry.get_sample_value("picker_flow_queue_wait_seconds_sum") == 1.0


def test_kv_without_room_for_the_prompt_holds():
    router, flow, clock, _ = flow_router(waiting=0, kv=0.99, running=4)  # 640 KV tokens free
    held = flow.submit(info(prompt="x" * 4 * 2000), lambda o: None)  # ~2,000 tokens
    assert isinstance(held, Held)
    small = flow.submit(info(prompt="short"), lambda o: None)
    assert isinstance(small, Held)  # FIFO: no overtaking of the held head


def test_expiry_answers_503_or_429_with_the_reason_and_counts_it():
    router, flow, clock, metrics = flow_router(waiting=3, max_wait=30.0, max_wait_sheddable=5.0)
    outcomes = {}
    flow.submit(info(), lambda o: outcomes.setdefault("normal", o))
    flow.submit(info(objective="batch"), lambda o: outcomes.setdefault("batch", o))
    clock.t += 5.0
    scrape_all(router, clock, waiting=3)  # fresh signals, still no room
    flow.pump()
    assert outcomes["batch"].status == 429 and outcomes["batch"].code == "queue_timeout"
    assert "normal" not in outcomes
    clock.t += 25.0
    scrape_all(router, clock, waiting=3)
    flow.pump()
    err = outcomes["normal"]
    assert isinstance(err, PickerError) and err.status == 503 and err.code == "queue_timeout"
    assert b'"queue_timeout"' in err.openai_body() and "30s" in err.message
    assert sample(metrics, "picker_flow_evictions_total", reason="expired", priority="-10") == 1
    assert sample(metrics, "picker_flow_evictions_total", reason="expired", priority="0") == 1


def test_full_queue_refuses_sheddable_with_429_and_evicts_it_for_interactive():
    router, flow, clock, metrics = flow_router(waiting=3, max_requests=1)
    outcomes = []
    flow.submit(info(objective="batch"), outcomes.append)
    with pytest.raises(PickerError) as refused:
        flow.submit(info(objective="batch"), outcomes.append)
    assert refused.value.status == 429 and refused.value.code == "queue_full"
    flow.submit(info(objective="interactive"), outcomes.append)
    assert outcomes[0].status == 429 and outcomes[0].code == "queue_evicted"
    assert sample(metrics, "picker_flow_queued_requests", priority="10") == 1
    assert sample(metrics, "picker_flow_queued_requests", priority="-10") == 0


def test_cancel_leaves_the_queue_and_is_counted():
    router, flow, clock, metrics = flow_router(waiting=3)
    held = flow.submit(info(), lambda o: None)
    assert sample(metrics, "picker_flow_queued_requests", priority="0") == 1
    flow.cancel(held)
    flow.publish()
    assert len(flow.queue) == 0
    assert sample(metrics, "picker_flow_queued_requests", priority="0") == 0
    assert sample(metrics, "picker_flow_evictions_total", reason="cancelled", priority="0") == 1


def test_stale_pool_is_held_for_the_stale_hold_then_not_held():
    router, flow, clock, _ = flow_router(waiting=3)   # no room; staleness 1 s, stale hold 5 s
    scraped = clock.t
    outcomes = []
    first = flow.submit(info("a"), lambda o: outcomes.append(("a", o)))
    clock.t += 2.0  # every scrape is stale, but only just: a stall, not lost signals
    second = flow.submit(info("b"), lambda o: outcomes.append(("b", o)))
    assert isinstance(first, Held) and isinstance(second, Held)
    assert flow.pump() == 0 and outcomes == []   # the queue is not dumped into the engines
    assert flow.next_deadline() == scraped + 1.0 + 5.0   # before the 30 s age bound
    clock.t = scraped + 6.5   # stale beyond the hold: the signals are lost, nothing is held
    assert flow.pump() == 2
    assert [name for name, _ in outcomes] == ["a", "b"]   # in the queue's order
    assert all(o.endpoint in router.endpoints for _, o in outcomes)
    assert flow.next_deadline() is None
    assert not isinstance(flow.submit(info("c"), lambda o: None), Held)


def test_a_new_request_on_a_briefly_stale_pool_is_held_until_fresh_signals():
    router, flow, clock, _ = flow_router(waiting=0)
    clock.t += 3.0   # stale, within the hold
    outcomes = []
    held = flow.submit(info(), outcomes.append)
    assert isinstance(held, Held) and flow.pump() == 0
    router.on_scrape_ok("10.0.0.1:8000", metrics_text(waiting=0), clock())
    assert flow.pump() == 1 and outcomes[0].endpoint == "10.0.0.1:8000"


def test_stale_hold_zero_holds_nothing_on_stale_signals():
    clock = FakeClock()
    router = make_router(profile="default", n=2, clock=clock, waiting=3)
    flow = FlowControl(router, FlowSettings(stale_hold=0.0))
    clock.t += 1.5
    assert not isinstance(flow.submit(info(), lambda o: None), Held)
    with pytest.raises(ValueError, match="stale hold"):
        FlowSettings(stale_hold=-1.0)


def test_sheddable_is_queued_not_shed_at_once():
    router, flow, clock, _ = flow_router(waiting=10, kv=0.9)  # pool saturation >= 1
    assert isinstance(flow.submit(info(objective="batch"), lambda o: None), Held)


def test_a_heavy_client_does_not_delay_a_light_one():
    router, flow, clock, _ = flow_router(waiting=3)
    served = []
    for i in range(20):
        flow.submit(info(prompt=f"heavy {i}", client="heavy"), lambda o, i=i: served.append(f"h{i}"))
    flow.submit(info(prompt="light", client="light"), lambda o: served.append("light"))
    for _ in range(3):  # room for one request per scrape
        clock.t += 0.1
        router.on_scrape_ok("10.0.0.1:8000", metrics_text(waiting=0), clock())
        flow.pump()
    assert served[:2] == ["h0", "light"]


def test_shutdown_sends_every_held_request_in_order_and_holds_nothing_after():
    router, flow, clock, metrics = flow_router(waiting=3)
    sent = []
    for name in ("first", "second"):
        flow.submit(info(prompt=name), lambda o, name=name: sent.append((name, o)))
    flow.submit(info(prompt="urgent", objective="interactive"),
                lambda o: sent.append(("urgent", o)))
    assert sent == [] and len(flow.queue) == 3
    assert flow.release_all() == 3
    assert [name for name, _ in sent] == ["urgent", "first", "second"]  # the queue's order
    assert all(o.endpoint in router.endpoints for _, o in sent)
    assert len(flow.queue) == 0
    assert sample(metrics, "picker_flow_evictions_total", reason="shutdown_dispatch",
                  priority="0") == 2
    assert sample(metrics, "picker_flow_queued_requests", priority="0") == 0
    late = flow.submit(info(prompt="late"), lambda o: None)  # still no room, but closing
    assert not isinstance(late, Held) and late.endpoint in router.endpoints


# ---- the ext_proc server ----------------------------------------------------------------------

@pytest.fixture
async def held_picker(ext_proc_server):
    metrics = PickerMetrics()
    router = make_router(profile="default", n=2, metrics=metrics, objectives=OBJECTIVES,
                         waiting=3, kv=0.5)
    router.clock = __import__("time").monotonic
    for a in router.endpoints:
        router.on_scrape_ok(a, metrics_text(waiting=3, kv=0.5))
    flow = FlowControl(router, FlowSettings(QueueLimits(max_wait=30.0)))
    servers = await start_servers(router, 0, 0, secure=False, host="127.0.0.1", flow=flow,
                                  server=ext_proc_server)
    await servers.set_ready(True)
    ch = c.channel(servers.grpc_port, None)
    yield router, flow, c.ep_stub(ch), servers
    await ch.close()
    await servers.stop(0)


async def until(pred, timeout=5.0):
    end = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < end, "condition not reached"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
async def test_server_holds_the_stream_until_a_scrape_shows_room(held_picker, mode):
    router, flow, stub, _ = held_picker
    send = c.send_buffered if mode == "buffered" else c.send_full_duplex
    task = asyncio.ensure_future(send(stub, c.post_headers(), body(prompt="held")))
    await until(lambda: len(flow.queue) == 1)
    assert not task.done()
    router.on_scrape_ok("10.0.0.1:8000", metrics_text(waiting=0, kv=0.5))  # room: dispatched
    call, answers = await asyncio.wait_for(task, 5.0)
    assert c.lb_destination(answers[-1] if mode == "buffered" else answers[0]) == "10.0.0.1:8000"
    call.cancel()


async def test_server_drops_a_held_request_when_the_stream_is_cancelled(held_picker):
    router, flow, stub, _ = held_picker
    call = stub.Process()
    await call.write(c.request_headers(c.post_headers(), mode=c.BUFFERED))
    await call.read()
    await call.write(c.request_body(body(prompt="going away"), True))
    await until(lambda: len(flow.queue) == 1)
    call.cancel()
    await until(lambda: len(flow.queue) == 0)


def test_command_line_flags_build_the_settings_and_refuse_bad_bounds():
    from picker.config import flow_settings, parse_args
    base = ["--discovery", "static", "--endpoints", "127.0.0.1:8101"]
    assert flow_settings(parse_args(base)) is None  # off unless asked for
    s = flow_settings(parse_args(base + ["--flow-control", "--flow-max-wait", "12",
                                         "--flow-max-wait-sheddable", "2"]))
    assert s.limits.max_wait == 12.0 and s.limits.wait_bound(-1) == 2.0
    with pytest.raises(SystemExit):
        parse_args(base + ["--flow-control", "--flow-max-wait", "0"])


def test_dispatch_at_bound_sends_normal_requests_early_and_still_refuses_sheddable():
    clock = FakeClock()
    metrics = PickerMetrics()
    router = make_router(profile="default", n=2, clock=clock, objectives=OBJECTIVES,
                         metrics=metrics, waiting=3, kv=0.5)
    flow = FlowControl(router, FlowSettings(QueueLimits(max_wait=10.0, max_wait_sheddable=2.0),
                                            RoomRule(), at_bound="dispatch"))
    outcomes = {}
    flow.submit(info(), lambda o: outcomes.setdefault("normal", o))
    flow.submit(info(objective="batch"), lambda o: outcomes.setdefault("batch", o))
    clock.t += 10.0
    scrape_all(router, clock, waiting=3)  # still no room anywhere
    flow.pump()
    assert outcomes["batch"].status == 429
    assert outcomes["normal"].endpoint in router.endpoints  # a decision, not an error
    assert sample(metrics, "picker_flow_evictions_total", reason="bound_dispatch", priority="0") == 1


# ---- holdback: room kept for a light client and for a higher band ------------------------------

def test_recent_arrivals_hold_back_a_client_over_its_share_and_a_lower_band():
    from picker.flowcontrol.activity import RecentArrivals
    a = RecentArrivals(window=10.0)
    for t in range(5):
        a.add(float(t), 0, "heavy")
    assert not a.must_hold_back(5.0, 0, "heavy")          # alone in its band: nobody to leave room for
    a.add(5.0, 0, "light")
    assert a.must_hold_back(5.0, 0, "heavy") and not a.must_hold_back(5.0, 0, "light")
    a.add(6.0, 10, "other")
    assert a.must_hold_back(6.0, 0, "light")              # a higher band is active
    assert not a.must_hold_back(6.0, 10, "other")
    assert not a.alone(6.0, 10, "other") and not a.alone(6.0, 0, "heavy")
    assert not a.must_hold_back(16.5, 0, "heavy")         # all of it older than the window
    assert a.alone(16.5, 0, "heavy")
    with pytest.raises(ValueError):
        RecentArrivals(window=0)


def test_room_with_holdback_needs_the_reserve_free_beyond_the_request():
    from picker.scheduling.context import SchedulingContext
    from picker.flowcontrol.room import has_room
    router, flow, clock, _ = flow_router(waiting=0, kv=0.75)  # 16,000 of 64,000 KV tokens free
    e = router.endpoints["10.0.0.1:8000"]
    ctx = SchedulingContext("qwq", 1000, None, 0, clock())
    rule = RoomRule(holdback_fraction=0.3)                    # 19,200 tokens to leave free
    assert has_room(e, ctx, rule) and not has_room(e, ctx, rule, holdback=True)
    assert has_room(e, ctx, RoomRule(holdback_fraction=0.2), holdback=True)
    with pytest.raises(ValueError):
        RoomRule(holdback_fraction=1.0)


def test_light_client_takes_the_room_a_heavy_one_must_leave():
    router, flow, clock, _ = flow_router(waiting=3)
    served = []
    for i in range(5):
        flow.submit(info(prompt=f"heavy {i}", client="heavy"), lambda o, i=i: served.append(f"h{i}"))
    flow.submit(info(prompt="light", client="light"), lambda o: served.append("light"))
    clock.t += 0.1
    scrape_all(router, clock, waiting=0, kv=0.75)   # room for a request, not beyond the reserve
    flow.pump()
    assert served == ["light"]                      # the heavy head waits, the light one goes
    clock.t += 0.1
    scrape_all(router, clock, waiting=0, kv=0.1)    # plenty of room: the heavy backlog goes
    flow.pump()
    assert served[1:] == ["h0", "h1", "h2", "h3", "h4"]


def test_a_busier_client_in_a_pool_with_room_is_not_held():
    """A chat client sending 3x the requests of a reasoning client is over its share of the
    arrivals; while the pool can start every request as it comes, nothing is held for a reserve."""
    router, flow, clock, _ = flow_router(waiting=0, kv=0.75)   # room, not beyond the reserve
    outcomes = []
    for i in range(8):
        client = "reasoning" if i % 4 == 1 else "chat"
        clock.t += 0.01
        outcomes.append(flow.submit(info(prompt=f"{client} {i}", client=client), lambda o: None))
    assert flow.arrivals.must_hold_back(clock(), 0, "chat")   # over its share...
    assert not any(isinstance(o, Held) for o in outcomes)       # ...and never held


def saturated_then_room(max_wait=300.0):
    """A chat client over its share (3 to 1); a chat request found no room anywhere (the pool is
    saturated) and waits; then a scrape shows room, not beyond the reserve."""
    router, flow, clock, _ = flow_router(waiting=0, kv=0.75, max_wait=max_wait)
    submit = lambda client, i: flow.submit(info(prompt=f"{client} {i}", client=client), lambda o: None)
    submit("reasoning", 0)
    assert not isinstance(submit("chat", 0), Held) and not isinstance(submit("chat", 1), Held)
    scrape_all(router, clock, waiting=2)            # no room anywhere: the pool is saturated
    blocked = submit("chat", 2)
    assert isinstance(blocked, Held)
    clock.t += 1.0
    scrape_all(router, clock, waiting=0, kv=0.75)
    return router, flow, clock, submit, blocked


def test_once_saturated_the_busier_client_keeps_the_reserve_while_requests_wait():
    router, flow, clock, submit, blocked = saturated_then_room()
    assert flow.pump() == 0 and blocked.queued      # the busier client leaves the reserve...
    assert not submit("reasoning", 1).queued        # ...that the other one takes
    clock.t += 1.0
    scrape_all(router, clock, waiting=0, kv=0.1)    # room beyond the reserve: the backlog goes
    assert flow.pump() == 1 and not len(flow.queue)
    clock.t += 1.0
    scrape_all(router, clock, waiting=0, kv=0.75)   # nothing waits, nothing was refused:
    assert flow.arrivals.must_hold_back(clock(), 0, "chat")   # still the busier client, but
    assert not isinstance(submit("chat", 3), Held)            # no reserve any more


def test_a_refusal_keeps_the_pool_saturated_for_an_activity_window():
    router, flow, clock, submit, blocked = saturated_then_room(max_wait=10.0)
    clock.t += 10.0
    scrape_all(router, clock, waiting=2)
    flow.pump()                                     # the chat request waited out its bound: refused
    assert not blocked.queued and not len(flow.queue)
    for step in (60.0, 59.0):                       # within the window of that refusal
        clock.t += step
        scrape_all(router, clock, waiting=0, kv=0.75)
        assert not isinstance(submit("reasoning", step), Held)
        held = [submit("chat", step), submit("chat", step + 0.5)]
        assert all(h.queued for h in held)          # the busier client keeps the reserve
        assert flow.pump() == 0
        for h in held:
            flow.cancel(h)
    clock.t += 2.0                                  # 121 s after the refusal, nothing waits
    scrape_all(router, clock, waiting=0, kv=0.75)
    assert not isinstance(submit("chat", 4), Held)


def test_lower_band_leaves_the_reserve_while_a_higher_band_is_active():
    router, flow, clock, _ = flow_router(waiting=0, kv=0.75, max_wait=300.0)
    assert isinstance(flow.submit(info(), lambda o: None), Held) is False  # nothing above it yet
    flow.submit(info(objective="interactive"), lambda o: None)
    held = flow.submit(info(prompt="standard"), lambda o: None)
    assert isinstance(held, Held)                   # the interactive band arrived lately
    d = flow.submit(info(objective="interactive"), lambda o: None)
    assert not d.queued                             # the reserve is the higher band's: it went
    assert held.queued
    clock.t += 200.0                                # the interactive band went quiet
    scrape_all(router, clock, waiting=0, kv=0.75)
    assert flow.pump() == 1 and not held.queued


@pytest.mark.parametrize("contested", [None, "light", "band"])
def test_dispatch_uncontested_at_bound_sends_a_lone_client_and_refuses_the_others(contested):
    router, flow, clock, metrics = flow_router(waiting=3, max_wait=10.0, at_bound="dispatch-uncontested")
    outcomes = []
    flow.submit(info(client="heavy"), outcomes.append)
    flow.submit(info(prompt="again", client="heavy"), outcomes.append)
    if contested == "light":
        flow.submit(info(prompt="light", client="light"), lambda o: None)
    elif contested == "band":   # a lower band: it holds back, the heavy client does not
        flow.submit(info(prompt="batch", client="heavy", objective="batch"), lambda o: None)
    clock.t += 10.0
    scrape_all(router, clock, waiting=3)            # still no room anywhere
    flow.pump()
    if contested:   # in an engine's FIFO it would go ahead of the others' later requests
        assert [o.status for o in outcomes] == [503, 503]
    else:           # the engine's FIFO serves it as the picker would: no need to refuse it
        assert all(o.endpoint in router.endpoints for o in outcomes)
        assert sample(metrics, "picker_flow_evictions_total", reason="bound_dispatch", priority="0") == 2


def test_holdback_flags_and_the_default_at_bound():
    from picker.config import flow_settings, parse_args
    base = ["--discovery", "static", "--endpoints", "127.0.0.1:8101", "--flow-control"]
    s = flow_settings(parse_args(base))
    assert s.at_bound == "dispatch-uncontested" and s.room.holdback_fraction == 0.3
    s = flow_settings(parse_args(base + ["--flow-holdback", "0", "--flow-activity-window", "5",
                                         "--flow-at-bound", "reject"]))
    assert s.room.holdback_fraction == 0.0 and s.activity_window == 5.0 and s.at_bound == "reject"
    for bad in (["--flow-holdback", "1"], ["--flow-activity-window", "0"], ["--flow-at-bound", "x"]):
        with pytest.raises(SystemExit):
            parse_args(base + bad)
    with pytest.raises(ValueError):
        FlowSettings(at_bound="later")


def test_a_newcomer_is_tried_at_once_only_if_it_may_use_the_reserve_the_head_leaves():
    router, flow, clock, _ = flow_router(waiting=3)
    served = []
    flow.submit(info(prompt="first", client="heavy"), lambda o: served.append("first"))
    router.on_scrape_ok("10.0.0.1:8000", metrics_text(waiting=0, kv=0.75), clock())  # no pump yet
    flow.submit(info(prompt="second", client="heavy"), lambda o: served.append("second"))
    assert served == []   # one client: nothing holds back, the queue waits for the next pump
    flow.submit(info(prompt="light", client="light"), lambda o: served.append("light"))
    assert served == ["light"]   # the heavy head leaves the reserve, the light request takes it


def affinity_setup(affinity_tokens):
    clock = FakeClock()
    router = make_router(profile="default", n=2, clock=clock, waiting=0, kv=0.1)
    flow = FlowControl(router, FlowSettings(room=RoomRule(affinity_tokens=affinity_tokens)))
    prompt = "tenant system prompt " * 400            # ~2,000 tokens
    first = flow.submit(info(prompt=prompt), lambda o: None)
    assert not isinstance(first, Held)
    other = next(a for a in router.endpoints if a != first.endpoint)
    clock.t += 1.0
    router.on_scrape_ok(first.endpoint, metrics_text(waiting=1, kv=0.5), clock())  # no room
    router.on_scrape_ok(other, metrics_text(waiting=0, kv=0.1), clock())
    return flow, prompt, first.endpoint, other


def test_a_cached_prefix_keeps_its_endpoint_without_room_as_a_candidate():
    flow, prompt, cached, _ = affinity_setup(affinity_tokens=1024)
    d = flow.submit(info(prompt=prompt + " question"), lambda o: None)
    assert not isinstance(d, Held) and d.endpoint == cached and d.cached_tokens >= 1024


def test_a_prefix_below_the_affinity_threshold_goes_to_the_endpoint_with_room():
    flow, prompt, _, other = affinity_setup(affinity_tokens=10 ** 6)
    d = flow.submit(info(prompt=prompt + " question"), lambda o: None)
    assert not isinstance(d, Held) and d.endpoint == other


def test_a_request_that_holds_back_leaves_an_affine_endpoint_without_room_alone():
    flow, prompt, _, other = affinity_setup(affinity_tokens=1024)
    flow.arrivals.add(flow.router.clock(), 10, "")     # a higher band is active: hold back
    d = flow.submit(info(prompt=prompt + " question"), lambda o: None)
    assert not isinstance(d, Held) and d.endpoint == other


def test_no_endpoint_with_room_holds_even_with_a_cached_prefix():
    flow, prompt, cached, other = affinity_setup(affinity_tokens=1024)
    flow.router.on_scrape_ok(other, metrics_text(waiting=2, kv=0.5), flow.router.clock())
    assert isinstance(flow.submit(info(prompt=prompt + " question"), lambda o: None), Held)


def test_affinity_flag_builds_the_room_rule_and_refuses_a_negative_value():
    from picker.config import flow_settings, parse_args
    base = ["--discovery", "static", "--endpoints", "127.0.0.1:8101", "--flow-control"]
    assert flow_settings(parse_args(base)).room.affinity_tokens == 1024
    assert flow_settings(parse_args(base + ["--flow-affinity-tokens", "0"])).room.affinity_tokens == 0
    with pytest.raises(SystemExit):
        parse_args(base + ["--flow-affinity-tokens", "-1"])


async def test_server_stop_answers_a_held_stream_with_an_endpoint_not_an_error(held_picker):
    router, flow, stub, servers = held_picker
    task = asyncio.ensure_future(
        c.send_buffered(stub, c.post_headers(), body(prompt="held at shutdown")))
    await until(lambda: len(flow.queue) == 1)
    await servers.stop(1.0)  # what SIGTERM runs
    call, answers = await asyncio.wait_for(task, 5.0)
    assert c.lb_destination(answers[-1]) in router.endpoints
    assert sample(router.metrics, "picker_flow_evictions_total", reason="shutdown_dispatch",
                  priority="0") == 1


async def test_server_stop_ends_an_answered_stream_cleanly_at_once(ext_proc_server):
    """Envoy keeps the stream of a routed request open until its response ends; a stop must end
    it with OK (Envoy finishes the request) rather than cut it after the grace (Envoy: 503)."""
    router = make_router(profile="default", n=2, waiting=0, kv=0.1)
    servers = await start_servers(router, 0, 0, secure=False, host="127.0.0.1", server=ext_proc_server)
    await servers.set_ready(True)
    ch = c.channel(servers.grpc_port, None)
    try:
        call, answers = await c.send_buffered(c.ep_stub(ch), c.post_headers(), body(prompt="hi"))
        assert c.lb_destination(answers[-1]) in router.endpoints
        loop = asyncio.get_running_loop()
        started = loop.time()
        stopping = asyncio.ensure_future(servers.stop(10.0))
        assert await asyncio.wait_for(call.code(), 5.0) == __import__("grpc").StatusCode.OK
        assert loop.time() - started < 2.0  # not the 10 s grace
        await asyncio.wait_for(stopping, 5.0)
    finally:
        await ch.close()


def relay(*flows: FlowControl) -> None:
    """What the signals process does between workers: each one's new arrivals to the others."""
    batches = [(f, f.arrivals.take_new()) for f in flows]
    for f, batch in batches:
        for other in flows:
            if other is not f and batch is not None:
                other.arrivals.add_peers(*batch)


def test_shared_arrivals_are_taken_once_and_peers_are_not_sent_back():
    from picker.flowcontrol.activity import RecentArrivals
    a, b = RecentArrivals(window=10.0), RecentArrivals(window=10.0)
    calls = []
    a.share(on_new=lambda: calls.append(1))
    assert a.take_new() is None
    a.add(1.0, 0, "heavy")
    a.add(2.0, 0, "heavy")
    a.add(2.0, 10, "light")
    assert len(calls) == 1                          # one flush per batch, not per arrival
    assert a.take_new() == (2.0, {(0, "heavy"): 2, (10, "light"): 1})
    assert a.take_new() is None
    b.share()
    b.add(1.5, 0, "std")
    b.add_peers(2.0, {(0, "heavy"): 2, (10, "light"): 1})
    assert b.take_new() == (1.5, {(0, "std"): 1})  # only its own: nothing echoes back
    assert b.must_hold_back(2.0, 0, "std")          # the peer's higher band counts here
    assert b.must_hold_back(11.8, 0, "heavy")       # its own arrival left the window, the peer's not
    assert not b.alone(11.8, 0, "heavy")
    assert not b.must_hold_back(12.5, 0, "heavy")   # and the peer's leaves it like its own
    assert b.alone(12.5, 0, "std")
    b.add(20.0, 0, "std")
    b.add_peers(19.0, {(10, "light"): 1})           # a batch older than the last arrival here
    assert b.must_hold_back(29.5, 0, "std")         # counts from that arrival on


def waits(outcome) -> bool:
    return isinstance(outcome, Held) and outcome.queued


@pytest.mark.parametrize("other", ["light client", "higher band"])
@pytest.mark.parametrize("shared", [True, False])
def test_a_worker_that_saw_only_the_heavy_client_holds_back_once_it_shares_arrivals(other, shared):
    clock = FakeClock()
    _, a, _, _ = flow_router(waiting=3, clock=clock, max_wait=300.0)   # no room yet
    _, b, _, _ = flow_router(waiting=0, kv=0.75, clock=clock, max_wait=300.0)
    for f in (a, b):
        f.arrivals.share()
    theirs = (info(prompt=big("light"), client="light") if other == "light client"
              else info(prompt=big("interactive"), objective="interactive", client="heavy"))
    assert not waits(b.submit(theirs, lambda o: None))
    held = [a.submit(info(prompt=big(f"heavy {i}"), client="heavy"), lambda o: None) for i in range(6)]
    clock.t += 0.01
    if shared:
        relay(a, b)
    scrape_all(a.router, clock, waiting=0, kv=0.75)   # room for 4 of the 6 held: saturated
    # shared: a leaves the reserve for b's client; else alone as far as a knows: it fills the room
    assert a.pump() == (0 if shared else 4)
    clock.t += 200.0                                # everyone went quiet: no reserve any more
    scrape_all(a.router, clock, waiting=0, kv=0.75)
    assert a.pump() == (4 if shared else 2) and sum(h.queued for h in held) == (2 if shared else 0)
