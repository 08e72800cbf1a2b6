"""Per-step logprobs: a plain step's rows kept whole as host arrays, sequences keeping (rows,
row) per token, and LazyLogprobs making the same dicts from them as an eager build would."""

from __future__ import annotations

import copy
import pickle
import random

import pytest
import torch

from nanopaged.engine.block_manager import BlockManager
from nanopaged.engine.scheduler import Scheduler
from nanopaged.engine.sequence import Sequence, SequenceStatus
from nanopaged.outputs import LazyLogprobs, Logprob
from nanopaged.sampling.output import SampleOutput, StepHandle, StepLogprobs
from nanopaged.sampling_params import SamplingParams

VOCAB = 300
EOS = VOCAB + 1  # never sampled


def _random_step(rng: random.Random, widths: list[int | None], k: int) -> StepHandle:
    """A CPU step's handle over random samples: some sampled tokens inside their row's top-k,
    some outside; fp32 values with ties."""
    rows = len(widths)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    top_v = -(torch.rand(rows, k, generator=gen) * 8).sort(dim=-1).values  # best first
    if k > 1:
        top_v[0, 1] = top_v[0, 0]  # a tie
    top_i = torch.stack([torch.randperm(VOCAB, generator=gen)[:k] for _ in range(rows)])
    tokens = torch.randint(VOCAB, (rows,), generator=gen)
    picked = -torch.rand(rows, generator=gen) * 9
    for r in range(rows):
        if k and rng.random() < 0.5:  # sampled from the top-k, its logprob a hair apart
            j = rng.randrange(k)
            tokens[r] = top_i[r, j]
            picked[r] = top_v[r, j] - (1e-7 if rng.random() < 0.5 else 0.0)
    ranks = torch.randint(1, VOCAB, (rows,), generator=gen)
    return StepHandle.copy_to_host(tokens, (picked, top_v, top_i, ranks), widths)


def _eager_rows(handle: StepHandle) -> list[tuple[float, dict, dict] | None]:
    """Each row's (sampled logprob, {token: logprob}, {token: rank}) built up front, row by
    row, from the step's values as Python numbers: the reference the lazy rows must equal."""
    tokens, picked, top_v, top_i, ranks = (t.tolist() for t in handle._copy.result())
    rows = []
    for r, want in enumerate(handle._logprob_widths):
        if want is None:
            rows.append(None)
            continue
        top = dict(zip(top_i[r][:want], top_v[r][:want]))
        rank = {t: j + 1 for j, t in enumerate(top_i[r][:want])}
        top[tokens[r]] = picked[r]
        rank[tokens[r]] = ranks[r]
        rows.append((picked[r], top, rank))
    return rows


def _text(token: int) -> str:
    return f"<{token}>"


def _decode(token_ids: list[int]) -> list[str]:
    return [_text(t) for t in token_ids]


def _logprob_dicts(raw: list[tuple[dict, dict]]) -> list[dict[int, Logprob]]:
    return [
        {tok: Logprob(lp, rank.get(tok), _text(tok)) for tok, lp in top.items()}
        for top, rank in raw
    ]


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_rows_give_the_dicts_of_the_eager_build(k):
    rng = random.Random(f"rows/{k}")
    for _ in range(10):
        widths = [rng.choice([None, 0, *range(1, k + 1)]) for _ in range(rng.randint(1, 40))]
        handle = _random_step(rng, widths, k)
        step = handle.logprobs()
        assert handle.logprobs() is step  # made once per step
        for r, want in enumerate(_eager_rows(handle)):
            if want is None:
                continue
            picked, top, rank = want
            tokens, logprobs, ranks = step.position(r)
            # Same floats, ints and order (the sampled token keeps its top-k place).
            assert tokens == list(top) and logprobs == list(top.values())
            assert ranks == [rank[t] for t in tokens]
            assert all(type(v) is float for v in logprobs)
            assert all(type(t) is int and type(v) is int for t, v in zip(tokens, ranks))
            assert step.logprobs[r] == picked and type(step.logprobs[r]) is float


def test_a_step_without_logprobs_has_none():
    handle = StepHandle.copy_to_host(torch.tensor([3, 4]))
    assert handle.logprobs() is None and handle.result() == [3, 4]


def _sched(num_blocks: int = 64, max_model_len: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4, True), 8, 100, max_model_len, {EOS})


def _seq(n: int, start: int = 0, **params) -> Sequence:
    params.setdefault("max_tokens", 8)
    params.setdefault("ignore_eos", True)
    return Sequence(list(range(start, start + n)), SamplingParams(**params))


def _step(s: Scheduler, rng: random.Random, k: int, asynchronous: bool = False, planned=None):
    """Take `planned` (else schedule a step), sample random rows with logprobs and hand them to
    the scheduler; asynchronous: schedule the next step between advance and commit where the
    engine would. Returns the handle, each row's sequence (None for a row dropped because its
    sequence ended first) and the step planned ahead, if any."""
    batch = planned or s.schedule()
    sampling = [q for i, q in enumerate(batch.seqs) if batch.sampling[i]]
    handle = _random_step(rng, [q.sampling_params.logprobs for q in sampling], k)
    ahead = asynchronous and s.can_look_ahead(batch)
    s.advance(batch)
    sampling = [q if q.pending_row is not None else None for q in sampling]
    following = s.schedule() if ahead else None
    s.commit(batch, handle.result(), handle.logprobs())
    return handle, sampling, following


@pytest.mark.parametrize("asynchronous", [False, True])
def test_sequences_keep_row_references_through_preemption(asynchronous):
    """Each generated token of a sequence that asked for logprobs is (the step's rows, its row),
    its cumulative logprob the running sum of the sampled tokens' logprobs; a sequence preempted
    by recompute keeps what it had and goes on appending."""
    rng = random.Random(f"preempt/{asynchronous}")
    # 5 blocks of 4: a and b (8 tokens each) take 4, and decoding needs one more each.
    s = _sched(num_blocks=5, max_model_len=20)
    a = _seq(8, logprobs=2)
    b = _seq(8, start=50, logprobs=0)
    c = _seq(1, start=90, max_tokens=3)  # no logprobs: rows it takes are skipped
    for q in (a, c, b):
        s.add(q)
    refs: dict[int, list] = {q.seq_id: [] for q in (a, b, c)}
    raw: dict[int, list] = {q.seq_id: [] for q in (a, b, c)}
    sums = {q.seq_id: 0.0 for q in (a, b, c)}
    preempted_with, planned = None, None
    while s.has_unfinished():
        handle, sampling, planned = _step(s, rng, 3, asynchronous, planned)
        step, eager = handle.logprobs(), _eager_rows(handle)
        for r, q in enumerate(sampling):
            if q is not None and eager[r] is not None:
                refs[q.seq_id].append((step, r))
                raw[q.seq_id].append(eager[r][1:])
                sums[q.seq_id] += eager[r][0]
        if b.status == SequenceStatus.WAITING and b.num_preemptions and preempted_with is None:
            preempted_with = list(b.logprobs)
    assert s.num_preemptions > 0 and preempted_with  # b was preempted with logprobs in hand
    assert (s.num_advanced_steps > 0) == asynchronous
    assert b.logprobs[: len(preempted_with)] == preempted_with
    for q in (a, b):
        assert q.num_output_tokens == 8 and len(q.logprobs) == 8
        assert q.logprobs == refs[q.seq_id]
        assert q.cumulative_logprob == sums[q.seq_id]  # the same additions, in order
        assert [rows.token_ids[row] for rows, row in q.logprobs] == q.output_token_ids
        # What an output makes of them: the eager dicts, with the decoder's texts.
        assert LazyLogprobs.from_rows(q.logprobs, _decode) == _logprob_dicts(raw[q.seq_id])
    assert c.logprobs == [] and c.cumulative_logprob == 0.0


def test_a_sequence_finished_in_flight_drops_its_row():
    """A sequence that ended while its step ran gets no row of it: the rows after its row still
    reach their own sequences."""
    rng = random.Random("finished")
    s = _sched()
    seqs = [_seq(3, start=10 * i, logprobs=1) for i in range(3)]
    for q in seqs:
        s.add(q)
    _step(s, rng, 2)
    batch = s.schedule()
    s.finish(seqs[1], "stop")
    handle = _random_step(rng, [1, 1, 1], 2)
    s.advance(batch)
    s.commit(batch, handle.result(), handle.logprobs())
    step = handle.logprobs()
    assert seqs[0].logprobs[-1] == (step, 0) and seqs[2].logprobs[-1] == (step, 2)
    assert len(seqs[1].logprobs) == 1
    assert seqs[2].output_token_ids[-1] == handle.result()[2]


def test_a_fork_shares_the_history_before_it():
    rng = random.Random("fork")
    s = _sched()
    parent = _seq(5, logprobs=3, max_tokens=20)
    s.add(parent)
    for _ in range(4):
        _step(s, rng, 3)
    child = parent.fork()
    assert len(child.logprobs) == 4
    assert all(c is p for c, p in zip(child.logprobs, parent.logprobs))  # no copies
    child.logprobs.append((SampleOutput([7], [-0.5], [{7: -0.5}], [{7: 1}]), 0))
    _step(s, rng, 3)  # the parent alone goes on
    assert len(parent.logprobs) == 5 and len(child.logprobs) == 5
    assert parent.logprobs[:4] == child.logprobs[:4] and parent.logprobs[4] != child.logprobs[4]
    parent_out = LazyLogprobs.from_rows(parent.logprobs, _decode)
    child_out = LazyLogprobs.from_rows(child.logprobs, _decode)
    assert parent_out[:4] == child_out[:4]
    assert child_out[4] == {7: Logprob(-0.5, 1, "<7>")}


def test_sample_output_positions():
    out = SampleOutput(
        [5, 6], [-0.1, -0.2], [{1: -0.05, 5: -0.1}, {1: -0.05, 6: -0.2}], [{1: 1, 5: 2}, {1: 1}]
    )
    assert out.position(1) == ([1, 6], [-0.05, -0.2], [1, None])
    # A beam's candidates come best first: candidate j is ranked j + 1.
    beam = SampleOutput([9, 3, 4], [-0.3, -1.5, -2.0])
    assert beam.position(0) == ([9], [-0.3], [1]) and beam.position(2) == ([4], [-2.0], [3])


def _history(rng: random.Random, num_tokens: int):
    """A sequence's references over random steps of 6 rows, and the eager raw dicts."""
    rows, raw = [], []
    for _ in range(num_tokens):
        handle = _random_step(rng, [rng.choice([None, 0, 2, 4]) for _ in range(6)], 4)
        eager = _eager_rows(handle)
        r = rng.choice([r for r, e in enumerate(eager) if e is not None] or [None])
        if r is None:
            continue
        rows.append((handle.logprobs(), r))
        raw.append(eager[r][1:])
    return rows, raw


def test_lazy_rows_read_each_position_once_and_only_when_read(monkeypatch):
    rows, raw = _history(random.Random("reads"), 150)
    reads = []
    position = StepLogprobs.position

    def spy(self, row):
        reads.append(row)
        return position(self, row)

    monkeypatch.setattr(StepLogprobs, "position", spy)
    lazy = LazyLogprobs.from_rows(rows, _decode)
    assert len(lazy) == len(rows) and reads == []
    want = _logprob_dicts(raw)
    assert lazy[3] == want[3] and lazy[-1] == want[-1] and len(reads) == 2
    assert lazy[3] is lazy[3] and len(reads) == 2
    assert list(lazy) == want and len(reads) == len(rows)


def test_pickled_and_copied_outputs_keep_the_contents_not_the_steps():
    rows, raw = _history(random.Random("pickle"), 80)
    want = _logprob_dicts(raw)
    calls = []

    def decode(token_ids):  # a closure: pickle could not carry it
        calls.append(token_ids)
        return _decode(token_ids)

    lazy = LazyLogprobs.from_rows(rows, decode)
    lazy[7]  # a read position travels as built
    data = pickle.dumps(lazy)
    assert b"StepLogprobs" not in data  # the steps' other rows stay behind
    loaded = pickle.loads(data)
    assert type(loaded) is LazyLogprobs and loaded == want and lazy == want
    assert pickle.loads(pickle.dumps(LazyLogprobs.from_rows(rows))) == [
        {t: Logprob(lp.logprob, lp.rank) for t, lp in d.items()} for d in want
    ]
    shallow = copy.copy(lazy)
    assert shallow == want and shallow[7] is lazy[7]
    deep = copy.deepcopy(lazy)
    assert deep == want and deep[7] is not lazy[7]
