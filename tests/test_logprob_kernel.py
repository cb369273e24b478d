"""The Triton log-probability kernels (kernels/logprobs.py) against torch.log_softmax and
torch.topk: interpreted on CPU tensors, compiled on a GPU. Rows span several chunks, the last
one partial; ties are broken towards the lowest id."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kernels.logprobs import LogprobScratch, _row_top_kernel, logprob_stats
from minisgl_backend.core import RowSampling, SamplingParams
from minisgl_backend.engine.controls import LogitControls
from minisgl_backend.engine.protocol import LogprobColumns, StepMessage, StepReply, decode
from tests.kernel_targets import devices

# The interpreter's numpy warns about -inf - -inf in the branch that tl.where then discards.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered")
VOCAB, CHUNK = 1300, 256


@pytest.mark.parametrize("device", devices(_row_top_kernel))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top", [0, 1, 5, 20])
def test_logprob_stats_equal_log_softmax_and_topk(device: str, dtype: torch.dtype,
                                                  top: int) -> None:
    gen = torch.Generator().manual_seed(top)
    logits = (torch.randn(7, VOCAB, generator=gen) * 4).to(dtype)
    logits[2, 1299] = 30.0  # the most likely token in the partial last chunk
    logits[3, :] = 0.5  # a flat row: every token ties, the lowest ids come first
    logits[3, [300, 40, 7]] = 2.0  # ... after three equal maxima in different groups
    logits[4, 700:] = float("-inf")  # masked tokens have no mass
    logits[6, 3:] = float("-inf")  # fewer allowed tokens than `top`: then masked ones, once each
    logits[5, 64:84] = torch.linspace(20, 10, 20)  # the most likely tokens in one group of 32
    logits[1, 5:1300:61] = torch.linspace(20, 10, 22)  # ... each in a group of its own
    lse, top_lp, top_ids = logprob_stats(logits.to(device), top, chunk=CHUNK)
    expected = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    assert torch.allclose(lse.cpu(), torch.logsumexp(logits.float(), dim=-1), atol=1e-5)
    want_lp, want_ids = expected.topk(top, dim=-1)
    assert top_ids.shape == (7, top) and top_ids.dtype == torch.int32
    assert top_lp.dtype == torch.float32
    top_lp, top_ids = top_lp.cpu(), top_ids.cpu().long()
    assert torch.allclose(top_lp, want_lp, atol=1e-5)
    # Each id's own log-probability; equal ones (bfloat16 has many) lowest id first.
    assert torch.allclose(expected.gather(1, top_ids), top_lp, atol=1e-5)
    for row in range(7):
        ids, values = top_ids[row].tolist(), top_lp[row].tolist()
        assert len(set(ids)) == top
        assert all(a < b for a, b, u, v in zip(ids, ids[1:], values, values[1:]) if u == v)
    if dtype == torch.float32:  # distinct values: torch's ids, in its order
        for row in (0, 1, 2, 4, 5):
            assert top_ids[row].tolist() == want_ids[row].tolist()
    flat = [7, 40, 300] + [i for i in range(top + 3) if i not in (7, 40, 300)]
    assert top_ids[3].tolist() == flat[:top]
    assert set(top_ids[6, :3].tolist()) <= {0, 1, 2}
    assert top_ids[6, 3:].tolist() == list(range(3, top))
    # A token's log-probability is its logit minus the logsumexp.
    token = torch.tensor([5, 9, 1299, 0, 699, 1000, 2])
    picked = logits.float().gather(1, token.unsqueeze(1)).squeeze(1) - lse.cpu()
    assert torch.allclose(picked, expected.gather(1, token.unsqueeze(1)).squeeze(1), atol=1e-5)


@pytest.mark.parametrize("device", devices(_row_top_kernel))
def test_logprob_stats_of_no_rows(device: str) -> None:
    lse, top_lp, top_ids = logprob_stats(torch.zeros(0, VOCAB, device=device), 3)
    assert lse.shape == (0,) and top_lp.shape == top_ids.shape == (0, 3)


@pytest.mark.parametrize("device", devices(_row_top_kernel))
@pytest.mark.parametrize("top", [0, 3])
def test_logprob_stats_write_into_the_steps_table(device: str, top: int) -> None:
    """`out`: the top columns of one `LogprobColumns` table (ids as int32 bit patterns), the
    token column left alone; equal to the kernels' own outputs."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)).to(device)
    cols = LogprobColumns(top)
    table = torch.full((4, cols.width), 7.0, device=device)
    lse, top_lp, top_ids = logprob_stats(logits, top, chunk=CHUNK, out=(
        table[:, cols.top_logprobs], table[:, cols.top_ids].view(torch.int32)))
    want_lse, want_lp, want_ids = logprob_stats(logits, top, chunk=CHUNK)
    assert torch.equal(lse, want_lse)
    assert top_lp.data_ptr() == table[:, cols.top_logprobs].data_ptr()
    assert torch.equal(table[:, cols.top_logprobs], want_lp)
    assert torch.equal(table[:, cols.top_ids].view(torch.int32), want_ids)
    assert (table[:, cols.token] == 7.0).all()
    # The reply reads the same table back on the host.
    reply = StepReply(np.zeros(4, np.int32), lp_rows=np.array([0, 2, 3, 5], np.int32),
                      logprobs=table.cpu().numpy().reshape(-1))
    read = StepReply.from_arrays(decode(reply.to_bytes())[1]).logprobs_of()
    assert sorted(read) == [0, 2, 3, 5]
    token, ids, values = read[2]
    assert token == 7.0 and list(ids) == want_ids[1].tolist()
    assert list(values) == want_lp[1].tolist()


@pytest.mark.parametrize("device", devices(_row_top_kernel))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top", [0, 4])
def test_logprob_stats_fill_the_sampled_tokens_column(device: str, dtype: torch.dtype,
                                                      top: int) -> None:
    """`sampled`: each row's token's log-probability into the table's token column (the
    logits as sampling read them); `scratch`, kept between calls, changes nothing."""
    logits = (torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    logits[1, 900:] = float("-inf")
    tokens = torch.tensor([0, 899, 1299, 256, 17])
    cols = LogprobColumns(top)
    scratch = LogprobScratch.allocate(5, VOCAB, top, torch.device(device), chunk=CHUNK)
    want = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    for _ in range(2):
        table = torch.full((5, cols.width), 7.0, device=device)
        lse, _, _ = logprob_stats(
            logits.to(device), top, chunk=CHUNK, scratch=scratch,
            out=(table[:, cols.top_logprobs], table[:, cols.top_ids].view(torch.int32)),
            sampled=(tokens.to(device, torch.int32), table[:, cols.token]))
        assert lse.data_ptr() == scratch.lse.data_ptr()
        assert torch.allclose(table[:, cols.token].cpu(), want, atol=1e-5)
        want_lse, want_lp, want_ids = logprob_stats(logits.to(device), top, chunk=CHUNK)
        assert torch.equal(lse, want_lse)
        assert torch.equal(table[:, cols.top_logprobs], want_lp)
        assert torch.equal(table[:, cols.top_ids].view(torch.int32), want_ids)
    with pytest.raises(AssertionError, match="chunk size"):  # the scratch's chunk, or none
        logprob_stats(logits.to(device), top, chunk=2 * CHUNK, scratch=scratch)


@pytest.mark.parametrize("device", devices(_row_top_kernel))
def test_controls_take_log_probabilities_after_sampling(device: str) -> None:
    """`LogitControls.sampled_logprobs` (on a GPU: the kernels writing the token column too,
    with tables kept between steps) gives what `raw_logprobs` then `report` give, and what
    log_softmax gives, for the rows that ask, over steps of changing batches."""
    controls = _reporting_controls(device)
    params = controls.params
    for rows, logits, tokens in _steps(device):
        got = controls.sampled_logprobs(logits, rows, tokens)
        raw = controls.raw_logprobs(logits, rows)
        assert got is not None and raw is not None
        two_steps = controls.report(raw, rows, tokens)
        wanted = np.nonzero(params.logprobs[rows] >= 0)[0]
        assert got.batch_rows.tolist() == two_steps.batch_rows.tolist() == wanted.tolist()
        torch.testing.assert_close(got.table.cpu(), two_steps.table.cpu(), rtol=0, atol=1e-5)
        cols = LogprobColumns.of_width(got.table.shape[1])
        assert cols.top == int(params.logprobs[rows[wanted]].max())
        expected = torch.log_softmax(logits.cpu()[wanted], dim=-1)
        table = got.table.cpu()
        assert torch.allclose(table[:, cols.token],
                              expected.gather(1, tokens.cpu()[wanted].unsqueeze(1)).squeeze(1),
                              atol=1e-5)
        assert torch.allclose(table[:, cols.top_logprobs], expected.topk(cols.top).values,
                              atol=1e-5)
    assert controls.sampled_logprobs(logits, np.array([1, 4]), tokens[:2]) is None


@pytest.mark.parametrize("device", devices(_row_top_kernel))
def test_log_probabilities_begun_beside_sampling_equal_those_taken_after_it(device: str) -> None:
    """`begin_logprobs` (on a GPU: the chunk kernel on a side stream, while the main stream
    works on) then `sampled_logprobs` with it give what `sampled_logprobs` alone gives; off the
    kernels' path nothing is begun."""
    controls = _reporting_controls(device)
    for rows, logits, tokens in _steps(device):
        pending = controls.begin_logprobs(logits, rows)
        if device == "cpu":
            assert pending is None
        else:
            assert pending is not None and pending.stream != torch.cuda.current_stream()
            busy = torch.randn(2048, 2048, device=device)
            for _ in range(8):  # the main stream's work between the halves (edits, sampling)
                busy = busy @ busy / 64
        got = controls.sampled_logprobs(logits, rows, tokens, pending)
        assert got is not None
        got_table = got.table.clone()  # the next call writes the same kept table
        want = controls.sampled_logprobs(logits, rows, tokens)
        assert want is not None and got.batch_rows.tolist() == want.batch_rows.tolist()
        assert torch.equal(got_table, want.table)
    assert controls.begin_logprobs(logits, np.array([1, 4])) is None


def _reporting_controls(device: str) -> LogitControls:
    """Controls of six table rows, four of them reporting log-probabilities (2, 5, 0 and 3
    top tokens)."""
    rows_total, vocab = 6, 700
    pool = torch.zeros(rows_total, 8, dtype=torch.int32, device=device)
    controls = LogitControls(rows_total, vocab, pool)
    admitted = np.arange(rows_total)
    admit = RowSampling.of([(SamplingParams(logprobs=None if n < 0 else n), 0)
                            for n in (2, -1, 5, 0, -1, 3)], vocab)
    controls.admit(StepMessage(is_prefill=True, admit_rows=admitted.tolist(), admit=admit))
    return controls


def _steps(device: str) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
    """Steps of changing batches of `_reporting_controls`' rows: table rows, raw logits,
    sampled tokens."""
    gen = torch.Generator().manual_seed(5)
    for batch in ([0, 1, 2, 3, 4, 5], [5, 2, 0], [0, 2, 3], [5, 2, 0]):
        rows = np.asarray(batch)
        logits = (torch.randn(len(rows), 700, generator=gen) * 3).to(device)
        tokens = torch.randint(0, 700, (len(rows),), generator=gen).to(device)
        yield rows, logits, tokens
