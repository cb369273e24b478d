"""KV-cache events and router metrics of the Triton model, against real servers.

Two servers of the default model publish events (page size 16): `a` with a 24-page KV pool, a
replay socket and a topic, `b` with the default pool. A subscriber written from vLLM's
published layout (tests/kv_event_subscriber.py) reads them. Requests go to the `minisgl` model
with `input_ids`, so that the test knows every token. The shared test server (events off) shows
that nothing is bound without them.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from minisgl_backend.benchmark.tritonserver import free_ports
from tests.kv_event_subscriber import Subscriber, chain_of, events_of, stored_blocks
from tests.test_isolation import _listening_tcp, _set_parameter, _socket_inodes
from tests.triton_fixtures import (  # noqa: F401 - triton_server is a fixture
    REPO_ROOT,
    GrpcStream,
    TritonServer,
    _cmdline,
    descendants,
    grpc_generate,
    start_server,
    tensor,
    triton_server,
)

PAGE = 16
POOL_PAGES = 24


@dataclass
class EventServer:
    server: TritonServer
    subscriber: Subscriber
    ports: tuple[int, int]  # the events' and the replay socket's


def _repository(root: Path, model_dir: Path, parameters: dict[str, str]) -> Path:
    repo = root / "model_repository"
    shutil.copytree(REPO_ROOT / "model_repository", repo,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("minisgl", "preprocessing"):
        path = repo / name / "config.pbtxt"
        path.write_text(_set_parameter(path.read_text(), "model", str(model_dir)))
    path = repo / "minisgl" / "config.pbtxt"
    config = path.read_text()
    for key, value in parameters.items():
        config = _set_parameter(config, key, value)
    path.write_text(config)
    return repo


def _start(root: Path, model_dir: Path, replay: bool, **parameters: str) -> EventServer:
    pub, rep = free_ports(2)
    settings = {"page_size": str(PAGE), "kv_events_endpoint": f"tcp://*:{pub}",
                **({"kv_events_replay_endpoint": f"tcp://*:{rep}"} if replay else {}),
                **parameters}
    server = start_server(root / "server.log", repository=_repository(root, model_dir, settings))
    subscriber = Subscriber(f"tcp://127.0.0.1:{pub}",
                            f"tcp://127.0.0.1:{rep}" if replay else None)
    return EventServer(server, subscriber, (pub, rep))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory,
            default_model: Path) -> Iterator[tuple[EventServer, EventServer]]:
    started: list[EventServer] = []
    try:
        started.append(_start(tmp_path_factory.mktemp("events-a"), default_model, True,
                              max_total_tokens=str(POOL_PAGES * PAGE), kv_events_topic="kv"))
        started.append(_start(tmp_path_factory.mktemp("events-b"), default_model, False))
    except RuntimeError as exc:
        for done in started:
            done.server.stop()
        pytest.fail(str(exc), pytrace=False)
    yield started[0], started[1]
    for done in started:
        done.subscriber.close()
        leftovers = done.server.stop()
        assert not leftovers, f"processes outlived the server: {leftovers}"


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(length)]


def _generate(target: EventServer, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy, to the `minisgl` model; the prompt followed by the tokens generated."""
    result = grpc_generate(target.server, [tensor("input_ids", prompt),
                                           tensor("max_tokens", max_tokens),
                                           tensor("ignore_eos", True)], model="minisgl")
    assert not result.errors, result.errors
    return prompt + result.ids


def test_every_full_page_of_a_prompt_is_stored_with_chained_hashes(servers) -> None:
    a, _ = servers
    prompt = _prompt(1, 100)
    tokens = _generate(a, prompt, 4)
    messages = a.subscriber.poll()
    blocks = stored_blocks(messages)
    chain = chain_of(blocks, tokens, PAGE)
    assert len(chain) == (len(tokens) - 1) // PAGE == len(blocks)  # every computed full page
    assert chain[:len(prompt) // PAGE] == chain_of(blocks, prompt, PAGE)
    assert {e["block_size"] for e in events_of(messages, "BlockStored")} == {PAGE}
    assert a.subscriber.topics == {b"kv"}


def test_two_servers_publish_equal_hashes_for_one_prompt(servers) -> None:
    a, b = servers
    prompt = _prompt(2, 60)
    _generate(a, prompt, 1)
    _generate(b, prompt, 1)
    on_a = chain_of(stored_blocks(a.subscriber.poll()), prompt, PAGE)
    on_b = chain_of(stored_blocks(b.subscriber.poll()), prompt, PAGE)
    assert len(on_a) == 3 and on_a == on_b


def test_eviction_publishes_block_removed_for_exactly_the_evicted_pages(servers) -> None:
    """The 24-page pool: a 22-page prompt takes it (whatever was cached goes); two prompts
    sharing 4 pages then evict it whole, and hold 12 pages; a 13-page request evicts the least
    recently used leaf, the first prompt's own 4 pages, and nothing else."""
    a, _ = servers
    a.subscriber.poll()
    flush = _prompt(3, 22 * PAGE)
    _generate(a, flush, 1)
    flushed = chain_of(stored_blocks(a.subscriber.poll()), flush, PAGE)
    assert len(flushed) == 22
    shared = _prompt(4, 4 * PAGE)
    first = _generate(a, shared + _prompt(5, 4 * PAGE), 1)
    messages = a.subscriber.poll()
    assert [h for e in events_of(messages, "BlockRemoved") for h in e["block_hashes"]] == \
        flushed
    _generate(a, shared + _prompt(6, 4 * PAGE), 1)
    messages += a.subscriber.poll()
    own = chain_of(stored_blocks(messages), first, PAGE)[4:]
    assert len(own) == 4
    _generate(a, _prompt(7, 200), 8)
    evicted = [h for e in events_of(a.subscriber.poll(), "BlockRemoved")
               for h in e["block_hashes"]]
    assert evicted == own


def test_a_subscriber_that_missed_messages_gets_them_from_the_replay_socket(servers) -> None:
    a, _ = servers
    _generate(a, _prompt(8, 40), 1)
    seen = a.subscriber.poll()
    assert seen
    late = Subscriber(*(f"tcp://127.0.0.1:{port}" for port in a.ports))
    try:
        assert late.poll(quiet_s=0.3) == []
        replayed = late.replay(seen[0].seq)
        assert [(m.seq, m.payload) for m in replayed] == [(m.seq, m.payload) for m in seen]
    finally:
        late.close()


def _stub_listening(server: TritonServer) -> set[int]:
    """The TCP ports the `minisgl` model's stub (and its engines) listen on."""
    listening = _listening_tcp()
    ports = set()
    for pid in descendants(server.process.pid):
        cmd = " ".join(_cmdline(pid))
        if "triton_python_backend_stub" in cmd and "/minisgl/" in cmd:
            for child in {pid} | descendants(pid):
                for inode in _socket_inodes(child) & listening.keys():
                    ports.add(int(listening[inode].split(":")[1], 16))
    return ports


def test_events_bind_their_endpoints_and_nothing_when_off(servers,
                                                          triton_server: TritonServer) -> None:
    a, b = servers
    assert _stub_listening(a.server) == set(a.ports)
    assert _stub_listening(b.server) == {b.ports[0]}
    assert _stub_listening(triton_server) == set()  # the shipped config: events off


def _router_samples(server: TritonServer) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.match(r'(vllm:[a-z_]+)\{model_name="minisgl"\} (\S+)$', line)
        if match:
            samples[match[1]] = float(match[2])
    return samples


def test_router_gauges_move_with_load(servers) -> None:
    """Four requests of 9 pages each on the 24-page pool: two run, the others wait."""
    a, _ = servers
    before = _router_samples(a.server)
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"} <= before.keys()
    prompts = [_prompt(20 + i, 120) for i in range(4)]
    done = threading.Event()

    def burst() -> None:
        with GrpcStream(a.server) as stream:
            for i, prompt in enumerate(prompts):
                stream.send([tensor("input_ids", prompt), tensor("max_tokens", 12),
                             tensor("ignore_eos", True)], f"r{i}", model="minisgl")
            results = stream.collect([f"r{i}" for i in range(len(prompts))], timeout=300)
        assert all(not r.errors for r in results.values())
        done.set()

    worker = threading.Thread(target=burst)
    worker.start()
    peak = {"vllm:num_requests_waiting": 0.0, "vllm:num_requests_running": 0.0,
            "vllm:kv_cache_usage_perc": 0.0}
    while not done.is_set():
        sample = _router_samples(a.server)
        for name in peak:
            peak[name] = max(peak[name], sample[name])
        time.sleep(0.1)
    worker.join()
    assert peak["vllm:num_requests_running"] >= 2 and peak["vllm:num_requests_waiting"] >= 1
    assert 0.5 < peak["vllm:kv_cache_usage_perc"] <= 1.0
    deadline = time.monotonic() + 5  # the gauges follow the scheduler's snapshots
    while (after := _router_samples(a.server))["vllm:num_requests_running"] and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] \
        == 4 * 120
