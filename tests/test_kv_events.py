"""KV-cache events from the offline `LLM` (the Triton model publishes through the same scheduler:
tests/test_kv_events_server.py), read by a subscriber written from vLLM's published layout
(tests/kv_event_subscriber.py), and the radix cache's reports they are made from."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zmq

from minisgl_backend import LLM, SamplingParams
from minisgl_backend.benchmark.tritonserver import free_ports
from minisgl_backend.kvcache import RadixPrefixCache
from tests.conftest import CHECKED, REPO_ROOT
from tests.kv_event_subscriber import Subscriber, chain_of, events_of, stored_blocks
from tests.test_lora import make_adapter

PAGE = 16
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


class Recorder:
    """A `CacheEvents` that keeps what it is told."""

    def __init__(self) -> None:
        self.reports: list[tuple[Any, ...]] = []

    def stored(self, parent_page: int | None, key: list[int], pages: list[int]) -> None:
        self.reports.append(("stored", parent_page, list(key), list(pages)))

    def removed(self, pages: list[int]) -> None:
        self.reports.append(("removed", list(pages)))

    def cleared(self) -> None:
        self.reports.append(("cleared",))


def test_radix_cache_reports_pages_entering_and_leaving_it() -> None:
    cache = RadixPrefixCache(page_size=2)
    cache.events = recorder = Recorder()
    cache.insert([1, 2, 3, 4], [10, 11])
    cache.insert([1, 2, 3, 4, 5, 6], [90, 91, 12])  # the first two pages were cached already
    cache.insert([1, 2, 7, 8], [92, 21])  # splits the first edge after one page
    assert recorder.reports == [("stored", None, [1, 2, 3, 4], [10, 11]),
                                ("stored", 11, [5, 6], [12]),
                                ("stored", 10, [7, 8], [21])]
    handle = cache.match([1, 2, 7, 8]).handle
    cache.lock(handle)
    recorder.reports.clear()
    freed = cache.evict(2)  # the unlocked leaves, least recently used first
    assert recorder.reports == [("removed", freed)] and sorted(freed) == [11, 12]
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.unlock(handle)
    assert recorder.reports == [("removed", freed)]
    assert sorted(cache.reset()) == [10, 21]
    assert recorder.reports[-1] == ("cleared",)
    assert cache.cached_pages == 0 and cache.match([1, 2]).cached_len == 0
    cache.check_invariants()


def test_events_off_import_and_bind_nothing() -> None:
    """Without an endpoint there is no publisher: ZeroMQ is not even imported."""
    code = ("import sys; from minisgl_backend.settings import EngineSettings; "
            "from minisgl_backend.scheduler import Scheduler; "
            "from minisgl_backend.kv_events import kv_event_publisher; "
            "assert kv_event_publisher(EngineSettings(), 'cpu', dict().get) is None; "
            "assert 'zmq' not in sys.modules, 'zmq imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_small_pages_and_unbindable_endpoints_are_refused(tiny_models: dict[str, Path]) -> None:
    (port,) = free_ports(1)
    endpoint = f"tcp://*:{port}"
    with pytest.raises(ValueError, match=r"page_size must be >= 16 when kv_events_endpoint"):
        LLM(tiny_models["llama"], device="cpu", page_size=8, kv_events_endpoint=endpoint)
    context = zmq.Context()
    taken = context.socket(zmq.PUB)
    taken.bind(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(ValueError, match=r"kv_events_endpoint: cannot bind"):
            LLM(tiny_models["llama"], device="cpu", page_size=PAGE, kv_events_endpoint=endpoint)
    finally:
        taken.close(linger=0)
        context.term()


class Instance:
    """An `LLM` publishing events, and a subscriber there before its first request. Local
    endpoints in `folder` are bound by the engine; with `connect`, the subscriber binds a
    loopback TCP port and the engine connects to it (as to llm-d's indexer)."""

    def __init__(self, model: Path, folder: Path, replay: bool = False, connect: bool = False,
                 **settings: Any) -> None:
        pub, rep = f"ipc://{folder}/events", f"ipc://{folder}/replay"
        if connect:
            pub = f"tcp://127.0.0.1:{free_ports(1)[0]}"
            self.subscriber = Subscriber(pub, bind=True)
        self.llm = LLM(model, device="cpu", page_size=PAGE, kv_events_endpoint=pub,
                       kv_events_replay_endpoint=rep if replay else "", kv_events_topic="kv",
                       hooks=CHECKED, **settings)
        self.endpoints = (pub, rep if replay else None)
        if connect:
            self.subscriber.settle()
        else:
            self.subscriber = Subscriber(*self.endpoints)

    def run(self, prompt: list[int], params: SamplingParams = GREEDY,
            lora: str | None = None) -> tuple[list[int], list]:
        """(the prompt's tokens followed by the generated ones, the messages it caused)."""
        out = self.llm.generate([prompt], params, lora=lora)[0]
        return prompt + out.token_ids, self.subscriber.poll()

    def close(self) -> None:
        self.subscriber.close()
        self.llm.shutdown()


@pytest.fixture(scope="module")
def instances(tiny_models: dict[str, Path],  # noqa: ANN201
              tmp_path_factory: pytest.TempPathFactory):
    """Two engines of one model: `a` with a replay socket and a LoRA adapter, `b` connecting to
    its subscriber, with a KV pool of 24 pages and n-gram speculative decoding."""
    model = tiny_models["llama"]
    folder = tmp_path_factory.mktemp("kv-events")
    adapter = make_adapter(model, folder / "tuned", 4, 8, ["q_proj", "v_proj"], False, seed=0)
    a = Instance(model, folder, replay=True, lora_adapters=f"tuned={adapter}", max_lora_rank=4)
    b = Instance(model, folder, connect=True, max_total_tokens=24 * PAGE, speculative="ngram")
    yield a, b
    a.close()
    b.close()


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 500 + 1 for i in range(length)]


def test_every_full_page_is_stored_once_with_its_tokens_and_chained_hashes(instances) -> None:
    a, _ = instances
    prompt = _prompt(1, 70)
    tokens, messages = a.run(prompt)
    stored = events_of(messages, "BlockStored")
    computed = len(tokens) - 1  # the last sampled token is never computed
    blocks = stored_blocks(messages)
    assert len(chain_of(blocks, tokens, PAGE)) == computed // PAGE == len(blocks)
    assert sum(len(e["block_hashes"]) for e in stored) == len(blocks)  # none stored twice
    assert chain_of(blocks, prompt, PAGE) == chain_of(blocks, tokens, PAGE)[:len(prompt) // PAGE]
    for event in stored:
        assert event["block_size"] == PAGE and event["medium"] == "CPU"
        assert event["lora_id"] is None and event["lora_name"] is None
    assert all(m.data_parallel_rank == 0 for m in messages)
    assert a.subscriber.topics == {b"kv"}
    assert not events_of(messages, "BlockRemoved")


def test_a_shared_prefix_stores_only_the_new_pages_after_it(instances) -> None:
    a, _ = instances
    first, _ = a.run(_prompt(2, 48))
    second = first[:32] + _prompt(3, 40)
    _, messages = a.run(second)
    stored = events_of(messages, "BlockStored")
    before = chain_of(stored_blocks(a.subscriber.messages), first, PAGE)
    assert stored[0]["parent_block_hash"] == before[1]
    assert stored[0]["token_ids"][:PAGE] == second[32:48]


def test_two_engines_publish_equal_hashes_for_equal_prompts(instances) -> None:
    a, b = instances
    prompt = _prompt(4, 50)
    _, on_a = a.run(prompt)
    _, on_b = b.run(prompt)
    hashes_a = chain_of(stored_blocks(on_a), prompt, PAGE)
    assert len(hashes_a) == 3
    assert chain_of(stored_blocks(on_b), prompt, PAGE) == hashes_a


def test_an_adapter_keys_its_blocks_apart(instances) -> None:
    a, _ = instances
    prompt = _prompt(5, 40)
    _, base = a.run(prompt)
    _, tuned = a.run(prompt, lora="tuned")
    (event,) = events_of(tuned, "BlockStored")
    assert event["lora_name"] == "tuned" and event["lora_id"] == 1
    assert event["token_ids"][:32] == prompt[:32]  # real token ids, not the cache's keys
    base_hashes = chain_of(stored_blocks(base), prompt, PAGE)
    assert len(base_hashes) == 2 and not set(base_hashes) & set(event["block_hashes"])


def test_the_replay_socket_returns_missed_messages(instances) -> None:
    a, _ = instances
    a.run(_prompt(6, 40))
    seen = a.subscriber.messages
    assert [m.seq for m in seen] == list(range(len(seen)))
    late = Subscriber(*a.endpoints)
    try:
        assert late.poll(quiet_s=0.3) == []  # published before it connected: missed
        replayed = late.replay(1)
        assert [(m.seq, m.payload) for m in replayed] == [(m.seq, m.payload) for m in seen[1:]]
    finally:
        late.close()


def test_a_reset_clears_every_block_and_equal_prompts_hash_alike_after_it(instances) -> None:
    a, _ = instances
    prompt = _prompt(7, 40)
    _, before = a.run(prompt)
    hashes = chain_of(stored_blocks(a.subscriber.messages), prompt, PAGE)
    assert a.llm.reset_prefix_cache()
    cleared = a.subscriber.poll()
    assert [e["type"] for m in cleared for e in m.events] == ["AllBlocksCleared"]
    _, after = a.run(prompt)
    assert chain_of(stored_blocks(after), prompt, PAGE) == hashes


def test_eviction_removes_exactly_the_evicted_pages(instances) -> None:
    """A 24-page pool: two prompts share 4 pages (each has 4 more of its own); a third needs
    13 pages where 12 are free, so the least recently used leaf goes: the first prompt's own
    4 pages, and nothing else."""
    _, b = instances
    assert b.llm.reset_prefix_cache()
    b.subscriber.poll()
    shared = _prompt(8, 64)
    one_shot = SamplingParams(max_tokens=1, temperature=0.0)
    first, _ = b.run(shared + _prompt(9, 64), one_shot)
    b.run(shared + _prompt(10, 64), one_shot)
    blocks = stored_blocks(b.subscriber.messages)
    own_pages = chain_of(blocks, first, PAGE)[4:]
    assert len(own_pages) == 4
    _, messages = b.run(_prompt(11, 200), SamplingParams(max_tokens=8, temperature=0.0,
                                                         ignore_eos=True))
    removed = events_of(messages, "BlockRemoved")
    assert [h for e in removed for h in e["block_hashes"]] == own_pages
    assert b.llm.scheduler.cache.evicted_pages == 4


def test_rejected_drafts_are_never_stored(instances) -> None:
    """n-gram drafts of a repetitive prompt, verified by a random model: mostly rejected; the
    stored blocks hold exactly the tokens kept."""
    _, b = instances
    speculator = b.llm.scheduler.speculator
    drafted, accepted = speculator.drafted, speculator.accepted
    tokens, messages = b.run([5, 6, 7, 8] * 10, SamplingParams(max_tokens=60, temperature=0.0,
                                                              ignore_eos=True))
    assert speculator.drafted - drafted > speculator.accepted - accepted  # some were rejected
    blocks = stored_blocks(messages)
    assert len(chain_of(blocks, tokens, PAGE)) == (len(tokens) - 1) // PAGE == len(blocks)


def test_tensor_parallel_ranks_publish_once(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """Two ranks, one publisher (the scheduler's): every page is stored once."""
    engine = Instance(tiny_models["llama"], tmp_path, tp_size=2)
    try:
        tokens, messages = engine.run(_prompt(12, 50))
    finally:
        engine.close()
    hashes = [h for e in events_of(messages, "BlockStored") for h in e["block_hashes"]]
    assert len(hashes) == len(set(hashes)) == (len(tokens) - 1) // PAGE
    assert len(chain_of(stored_blocks(messages), tokens, PAGE)) == len(hashes)
