"""Precise prefix routing in the lab: the engines' KV-cache events reach the picker's Router
(every replica on its own), in order, after the configured delay, and restarts start over."""

import pytest

from lab.policies import make_policy
from lab.simulation import LabConfig, prepare_requests, run_lab
from loadtest.workloads import build_workload


@pytest.fixture(scope="module")
def requests():
    specs = build_workload("shared-prefix", seed=100, num_prompts=40, num_groups=4,
                           system_prompt_len=600, question_len=100, output_len=40)
    return prepare_requests(specs, 16)


def drain(policy):
    """Deliver every batch still queued (the run ends before the last delays pass)."""
    policy._apply_kv(float("inf"))


def test_the_pickers_index_ends_equal_to_every_engines_cache(requests):
    policy = make_policy("picker+precise=0.05")
    assert policy.kv_events and policy.kv_delay == 0.05
    config = LabConfig(concurrency=8, seed=1,
                       engine_model=LabConfig().engine_model.with_overrides(num_gpu_blocks=200))
    run = run_lab(requests, policy, config)
    assert run.summary["completed"] == len(requests)
    drain(policy)
    precise = policy.router.precise
    assert precise.active and precise.untokenizable == 0
    evicted = 0
    for ep in policy.endpoints:
        assert precise.index.in_sync(ep.address)
        assert precise.index.counts[ep.address] == len(ep.engine.refs) > 0
        evicted += ep.engine.prefix_cache_queries - ep.engine.prefix_cache_hits
    assert evicted > 0


def test_events_wait_for_their_delay(requests):
    policy = make_policy("picker+precise=1000")
    run_lab(requests[:5], policy, LabConfig(concurrency=5, seed=1))
    assert policy.kv_queue and sum(policy.router.precise.index.counts.values()) == 0
    drain(policy)
    assert sum(policy.router.precise.index.counts.values()) > 0


def test_every_replica_gets_every_batch(requests):
    policy = make_policy("replicas:2:independent+precise")
    run_lab(requests, policy, LabConfig(concurrency=8, seed=1))
    for part in policy.parts:
        drain(part)
    counts = [dict(p.router.precise.index.counts) for p in policy.parts]
    assert counts[0] == counts[1] and sum(counts[0].values()) > 0
    assert {ep.address: len(ep.engine.refs) for ep in policy.endpoints} == counts[0]


def test_a_restarted_group_starts_empty_in_the_index(requests):
    policy = make_policy("picker+precise=0")
    config = LabConfig(concurrency=4, seed=1, outages=((0, 5.0, 6.0),))
    run = run_lab(requests, policy, config)
    assert run.summary["failed"] > 0                     # the group was busy when it failed
    drain(policy)
    index = policy.router.precise.index
    restarted = policy.endpoints[0]
    assert restarted.kv_seq > 0 and restarted.engine.refs   # it served again after the restart
    for e in policy.endpoints:                               # no block of the old engine is left
        assert index.counts.get(e.address, 0) == len(e.engine.refs)


def test_bad_precise_names_are_refused():
    with pytest.raises(ValueError, match="precise"):
        make_policy("picker+precise=soon")


def test_each_group_is_scraped_with_its_own_kv_capacity(requests):
    """A pool with one small-KV group: the picker sees each group's own num_gpu_blocks (a scrape
    page rendered for one group is never reused for another), so its tracker caps no group's
    blocks at another group's capacity."""
    base = LabConfig().engine_model
    models = [base.with_overrides(num_gpu_blocks=150)] + [base.with_overrides(num_gpu_blocks=400)] * 2
    policy = make_policy("picker+precise=0")
    run_lab(requests, policy, LabConfig(concurrency=8, seed=1, num_engines=3, engine_models=models))
    drain(policy)
    router, tracker = policy.router, policy.router.precise.tracker
    for ep, model in zip(policy.endpoints, models):
        assert router.endpoints[ep.address].metrics.num_gpu_blocks == model.num_gpu_blocks
        assert tracker.endpoints[ep.address].capacity == model.num_gpu_blocks
        assert tracker.endpoints[ep.address].stats.overflow == 0


def test_active_passive_replicas_decide_as_one_picker_with_warm_standbys(requests):
    one = run_lab(requests, make_policy("picker+precise"), LabConfig(concurrency=8, seed=1))
    policy = make_policy("replicas:2:active-passive+precise")
    assert policy.name == "replicas:2:active-passive+precise"
    leader, standby = policy.parts

    def standby_picks(request):
        raise AssertionError("a standby decided")

    standby.pick = standby_picks
    run = run_lab(requests, policy, LabConfig(concurrency=8, seed=1))
    assert run.summary["completed"] == len(requests)
    drain(leader)
    drain(standby)
    # ...but followed every engine: its index is the leader's, ready for a takeover
    assert dict(standby.router.precise.index.counts) == dict(leader.router.precise.index.counts)
    assert sum(leader.router.precise.index.counts.values()) > 0
    assert run.summary["mean_ttft_ms"] == one.summary["mean_ttft_ms"]


def test_a_linked_standby_takes_over_with_the_leaders_view(requests):
    """`failover=K`: the K+1-th request onwards is the standby's, which had the leader's prefix
    additions and in-flight counts (the peer link); a cold standby has only its own signals."""
    linked = make_policy("replicas:2:active-passive:failover=20+precise")
    cold = make_policy("replicas:2:active-passive:failover=20:cold+precise")
    assert linked.name == "replicas:2:active-passive:failover=20+precise"
    assert cold.name == "replicas:2:active-passive:failover=20:cold+precise"
    config = LabConfig(concurrency=8, seed=1)
    picked = {}
    for policy in (linked, cold):
        picked[policy] = counts = [0, 0]
        for i, part in enumerate(policy.parts):
            def counting(request, pick=part.pick, i=i, counts=counts):
                counts[i] += 1
                return pick(request)
            part.pick = counting
        assert run_lab(requests, policy, config).summary["completed"] == len(requests)
    assert picked[linked] == picked[cold] == [20, len(requests) - 20]
    # the linked standby learnt the leader's prefixes before it decided; the cold one did not
    assert linked.parts[1].router.prefix.size() >= linked.parts[0].router.prefix.size() > 0
    assert cold.parts[1].router.prefix.size() < linked.parts[1].router.prefix.size()
    # outcomes (Envoy's access log to the acting replica, relayed over the link): the linked
    # standby learnt from the leader's requests too, the cold one only from what ended once it
    # acted, the dead leader from nothing after it died; request ids are each replica's own
    learnt = {policy: [part.router.work.outcomes for part in policy.parts] for policy in (linked, cold)}
    assert learnt[linked][1] > learnt[cold][1] > 0, learnt
    assert learnt[linked][0] < learnt[linked][1], learnt
    assert linked.parts[0].router.id_prefix != linked.parts[1].router.id_prefix


def test_a_failover_needs_active_passive_replicas():
    with pytest.raises(ValueError):
        make_policy("replicas:2:failover=5")
    with pytest.raises(ValueError):
        make_policy("replicas:1:active-passive:failover=5")


def test_the_standby_holds_the_dead_leaders_recent_requests_until_its_scrapes_show_them(requests):
    """At the failover the linked standby keeps the dead leader's since-scrape counts (not its
    in-flight ones) for two scrape intervals, as peer_link.py does, then drops them. The failover
    falls in the opening burst (8 requests at once), before any scrape shows them."""
    policy = make_policy("replicas:2:active-passive:failover=5+precise")
    calls = []
    original = None

    def recording(loads, partial=False):
        calls.append((policy.clock(), dict(loads)))
        return original(loads, partial)
    start = policy.start

    def start_and_record(endpoints, clock, rng):
        nonlocal original
        start(endpoints, clock, rng)
        original = policy.parts[1].router.set_peer_loads
        policy.parts[1].router.set_peer_loads = recording
    policy.start = start_and_record
    assert run_lab(requests, policy, LabConfig(concurrency=8, seed=1)).summary["completed"] == len(requests)
    (held_at, held), (released_at, released) = calls[-2:]   # the failover, then the release
    assert held and all(load[0] == load[1] == 0 and load[2] > 0 for load in held.values()), held
    assert released == {}
    assert released_at - held_at >= 2 * policy.scrape_interval
