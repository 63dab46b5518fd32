"""free_ports picks ports a stack can still bind seconds later: outside the kernel's ephemeral
range (where any outgoing connection may take one meanwhile), distinct, and not listened on."""
import socket

from local.stack import processes
from local.stack.processes import free_ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    low = int(processes.EPHEMERAL_RANGE.read_text().split()[0])
    ports = free_ports(64)
    assert len(set(ports)) == 64
    assert all(low - processes.PICK_SPAN <= p < low for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_skipped(monkeypatch):
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    taken = listening.getsockname()[1]

    class TakenFirst:   # the draw puts the port in use first
        def sample(self, population, k):
            return [taken, *[p for p in population if p != taken][:k]]
    monkeypatch.setattr(processes.random, "SystemRandom", TakenFirst)
    try:
        ports = free_ports(3)
        assert taken not in ports and len(set(ports)) == 3
    finally:
        listening.close()


def test_without_room_below_the_range_the_kernel_picks(tmp_path, monkeypatch):
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text("2000\t60999\n")
    monkeypatch.setattr(processes, "EPHEMERAL_RANGE", narrow)
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(p >= 2000 for p in ports)
