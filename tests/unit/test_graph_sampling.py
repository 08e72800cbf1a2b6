"""Sampling inside the decode graphs: the persistent per-slot settings, the sampler paths a
graph captures, and the one decision of which steps sample there (on CPU, with a stand-in for
the graphs; tests/e2e/test_gpu.py replays the real ones)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_models import make_tiny_model

from nanopaged import LLM, SamplingParams
from nanopaged.engine.sequence import Sequence, SequenceGroup
from nanopaged.engine.step_inputs import StepInputs
from nanopaged.sampling.ops import (
    SAMPLER_PATHS,
    SlotSettings,
    sample,
    sampler_path,
    sampling_tensors,
    with_path,
)
from nanopaged.sampling.rows import StepRows
from nanopaged.sampling_params import BeamSearchParams, StructuredOutputsParams

SLOTS = 8


def _in_graph(runner, step, seqs):
    """The runner's decision for step, with its rows classified as launch classifies them."""
    settings = runner._graph_sampling(step, seqs, StepRows.of(seqs))
    return None if settings is None else settings()


@pytest.mark.parametrize("path", SAMPLER_PATHS)
def test_with_path_flags_select_that_path(path):
    st = sampling_tensors([SamplingParams(top_k=5)], [1], [0], torch.device("cpu"))
    assert sampler_path(st) == "full"
    assert sampler_path(with_path(st, path)) == path


def test_with_path_rejects_an_unknown_path():
    st = sampling_tensors([SamplingParams()], [1], [0], torch.device("cpu"))
    with pytest.raises(ValueError, match="sampler path must be one of"):
        with_path(st, "fast")


def test_sampler_path_follows_the_rows_settings():
    cpu = torch.device("cpu")

    def path(*params):
        return sampler_path(sampling_tensors(list(params), [0] * len(params),
                                             [0] * len(params), cpu))  # fmt: skip

    greedy, hot = SamplingParams(temperature=0), SamplingParams(temperature=0.8)
    assert path(greedy, greedy) == "greedy"
    assert path(greedy, hot) == "plain"
    assert path(hot, SamplingParams(min_p=0.1)) == "plain_min_p"
    assert path(hot, SamplingParams(top_p=0.9, min_p=0.1)) == "frontier"
    assert path(SamplingParams(top_p=0.9), SamplingParams(top_k=3)) == "full"


def test_slot_settings_hold_the_rows_and_greedy_padding():
    cpu = torch.device("cpu")
    slots = SlotSettings(SLOTS, cpu)
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=3),
              SamplingParams(temperature=1.2, top_k=7, min_p=0.05)]  # fmt: skip
    fresh = sampling_tensors(params, [11, -5], [4, 9], cpu)
    st = sampling_tensors(params, [11, -5], [4, 9], cpu, into=slots)
    for name in ("temperatures", "top_ks", "top_ps", "min_ps", "seeds", "offsets"):
        got, want = getattr(st, name), getattr(fresh, name)
        assert torch.equal(got, want), name
        assert got.dtype == want.dtype and got.is_contiguous()
    for flag in ("all_greedy", "all_plain", "any_min_p", "any_top_k"):
        assert getattr(st, flag) == getattr(fresh, flag), flag
    # The views are the persistent tensors' first rows: an in-place bump reaches the slots.
    assert st.temperatures.data_ptr() == slots.values.data_ptr()
    st.offsets.add_(1)
    assert slots.ints[2, :2].tolist() == [5, 10]
    # Rows past the batch are greedy with no filters; fewer rows later reset the rest.
    sampling_tensors(params[:1], [11], [4], cpu, into=slots)
    assert slots.values[:, 1:].tolist() == [[0.0] * 7, [1.0] * 7, [0.0] * 7]
    assert slots.ints[:, 1:].eq(0).all() and slots.top_ks[1:].eq(0).all()
    with pytest.raises(ValueError, match="do not fit 8 slots"):
        sampling_tensors([SamplingParams()] * 9, [0] * 9, [0] * 9, cpu, into=slots)


def test_slot_settings_sample_like_fresh_tensors():
    """The sampler reads the persistent views as it reads a step's own tensors."""
    cpu = torch.device("cpu")
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=0),
              SamplingParams(temperature=1.1, top_k=4, min_p=0.02)]  # fmt: skip
    seeds, offsets = [5, 6, 7], [0, 3, 8]
    fresh = sampling_tensors(params, seeds, offsets, cpu)
    slotted = sampling_tensors(params, seeds, offsets, cpu, into=SlotSettings(SLOTS, cpu))
    assert torch.equal(sample(logits, slotted).token_ids, sample(logits, fresh).token_ids)


# ---- the decision -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    llm = LLM(str(model), dtype="float32", device="cpu", kv_cache_memory=1 << 22)
    runner = llm.runner
    assert runner.graphs is None  # CPU: no graphs, so nothing samples in one
    return runner


@pytest.fixture
def graphs(runner):
    """A stand-in for the decode graphs of buckets up to SLOTS rows, sampling included."""
    stand_in = SimpleNamespace(can_sample=True, can_run=lambda bs: bs <= SLOTS,
                               slots=SlotSettings(SLOTS, runner.device))  # fmt: skip
    runner.graphs, runner._sampling_cache = stand_in, None
    yield stand_in
    runner.graphs, runner._sampling_cache = None, None


def _decode_step(n: int, tokens_per_row: int = 1) -> StepInputs:
    num = n * tokens_per_row
    z = np.zeros(num, dtype=np.int64)
    return StepInputs(
        input_ids=z, positions=z, slots=z, tables=np.zeros((n, 1), dtype=np.int32),
        context_lens=np.full(n, tokens_per_row, dtype=np.int32),
        cu_seqlens_q=np.arange(n + 1, dtype=np.int32) * tokens_per_row,
        logits_indices=np.arange(1, n + 1, dtype=np.int64) * tokens_per_row - 1,
        blocks_to_swap_out=[], blocks_to_swap_in=[], blocks_to_copy=[],
        pending_dst=np.zeros(0, dtype=np.int64), pending_src=np.zeros(0, dtype=np.int64),
    )  # fmt: skip


def _seqs(*params: SamplingParams, outputs: int = 1) -> list[Sequence]:
    seqs = []
    for p in params:
        seq = Sequence([1, 2, 3], p)
        seq.token_ids += [4] * outputs
        seq.seed = 123
        seqs.append(seq)
    return seqs


def test_plain_decode_steps_sample_in_the_graph(runner, graphs):
    seqs = _seqs(SamplingParams(temperature=0.8, top_p=0.95, seed=1),
                 SamplingParams(temperature=0), SamplingParams(top_k=40, min_p=0.05))  # fmt: skip
    st = _in_graph(runner, _decode_step(3), seqs)
    assert st is not None and sampler_path(st) == "full"
    assert st.temperatures.data_ptr() == graphs.slots.values.data_ptr()
    assert graphs.slots.values[0, :3].tolist() == pytest.approx([0.8, 0.0, 1.0])
    assert graphs.slots.ints[2, :3].tolist() == [1, 1, 1]  # each row's output position
    # The next step of the same sequences moves the offsets on in place.
    for seq in seqs:
        seq.token_ids.append(5)
    again = _in_graph(runner, _decode_step(3), seqs)
    assert again is st and graphs.slots.ints[2, :3].tolist() == [2, 2, 2]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(logprobs=2),
        SamplingParams(logprobs=0),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(repetition_penalty=1.2),
        SamplingParams(min_tokens=4),  # one output so far: EOS still masked
        SamplingParams(logit_bias={3: 2.0}),
        SamplingParams(allowed_token_ids=[1, 2]),
    ],
    ids=["logprobs", "logprobs0", "presence", "repetition", "min_tokens", "bias", "allowed"],
)
def test_rows_that_need_more_than_a_token_sample_outside(runner, graphs, params):
    seqs = _seqs(SamplingParams(temperature=0.7), params)
    assert _in_graph(runner, _decode_step(2), seqs) is None
    # min_tokens reached: the row is plain again.
    if params.min_tokens:
        assert _in_graph(runner, _decode_step(1), _seqs(params, outputs=4)) is not None


def test_rows_with_a_grammar_sample_in_the_graph_but_not_on_shards(runner, graphs):
    # The masked sampler replays once the masks are known (DecodeGraphs.run(masked=True));
    # with min_tokens still masking EOS the row samples outside, as any such row does.
    grammar = StructuredOutputsParams(regex="[a-f]{1,12}")
    seqs = _seqs(SamplingParams(temperature=0.7),
                 SamplingParams(temperature=0, structured_outputs=grammar))  # fmt: skip
    rows = StepRows.of(seqs)
    assert rows.constrained and rows.graph_safe and not rows.shardable
    assert _in_graph(runner, _decode_step(2), seqs) is not None
    early = _seqs(SamplingParams(min_tokens=4, structured_outputs=grammar))
    assert _in_graph(runner, _decode_step(1), early) is None


def test_forks_and_beams_sample_outside(runner, graphs):
    fork = _seqs(SamplingParams(n=3, temperature=0.9))[0]
    SequenceGroup("a", fork)  # its first sample forks it: n tokens from one row
    assert _in_graph(runner, _decode_step(1), [fork]) is None
    fork.group.mark_forked()  # forked samples are plain rows again
    assert _in_graph(runner, _decode_step(1), [fork]) is not None
    beam = _seqs(SamplingParams(temperature=0))[0]
    SequenceGroup("b", beam, BeamSearchParams(beam_width=2, max_tokens=8))
    assert _in_graph(runner, _decode_step(1), [beam]) is None


def test_steps_off_the_graph_sample_outside(runner, graphs):
    seqs = _seqs(*[SamplingParams(temperature=0.5)] * (SLOTS + 1))
    assert _in_graph(runner, _decode_step(SLOTS + 1), seqs) is None  # past the buckets
    two = seqs[:2]
    assert _in_graph(runner, _decode_step(2, tokens_per_row=3), two) is None  # prefill
    step = _decode_step(2)
    step.logits_indices = np.array([1], dtype=np.int64)  # a row that does not sample
    assert _in_graph(runner, step, two[1:]) is None
    graphs.can_sample = False  # tensor parallel: graphs without samplers
    assert _in_graph(runner, _decode_step(2), two) is None


def test_steps_with_drafts_draw_at_every_verified_position(runner, graphs):
    """A step with drafts, its tokens one-token rows (as_decode_rows), draws in the graph at
    each verified position: a row of settings per position, at the row's output position plus
    j; kept across steps with the same rows, the offsets moved on."""
    seqs = _seqs(SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.5))
    seqs[1].seed = 456
    drafts = [[7, 8], []]
    rows = StepRows.of(seqs, speculating=True)
    st = runner._graph_sampling(_decode_step(4), seqs, rows, drafts)()
    assert st is not None and st.temperatures.data_ptr() == graphs.slots.values.data_ptr()
    assert graphs.slots.values[0, :4].tolist() == pytest.approx([0.8, 0.8, 0.8, 0.5])
    assert graphs.slots.ints[2, :4].tolist() == [1, 2, 3, 1]  # output positions
    seed = graphs.slots.ints[1, :4].tolist()
    assert seed[0] == seed[1] == seed[2] != seed[3]
    for seq, new in zip(seqs, (3, 1)):  # row 0 took both drafts and a bonus token
        seq.token_ids += [5] * new
    again = runner._graph_sampling(_decode_step(4), seqs, rows, drafts)()
    assert again is st and graphs.slots.ints[2, :4].tolist() == [4, 5, 6, 2]
    # Rows and positions disagree (the step did not run as one-token rows): outside.
    assert runner._graph_sampling(_decode_step(2), seqs, rows, drafts) is None
    # A plain step of the same sequences writes its own settings again.
    plain = _in_graph(runner, _decode_step(2), seqs)
    assert plain is not None and graphs.slots.ints[2, :2].tolist() == [4, 2]


def test_early_stop_mask_bans_each_rows_stops_until_min_tokens():
    from nanopaged.sampling.penalties import mask_early_stops

    eos = {0, 7}
    seqs = _seqs(SamplingParams(min_tokens=3, stop_token_ids=[5]),  # banned: 5, EOS
                 SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[2, 9]),
                 SamplingParams(min_tokens=1),  # one output already: nothing banned
                 SamplingParams(min_tokens=2, ignore_eos=True))  # nothing to ban
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    mask_early_stops(logits, seqs, eos)
    banned = {0: {0, 5, 7}, 1: {2, 9}}
    for row in range(4):
        for tok in range(12):
            if tok in banned.get(row, ()):
                assert logits[row, tok] == float("-inf"), (row, tok)
            else:
                assert logits[row, tok] == before[row, tok], (row, tok)


@pytest.mark.parametrize("calculate", [True, False])
def test_first_pass_over_an_8bit_cache_is_eager(tmp_path, calculate):
    """An 8-bit cache's first forward pass sets (calculate_kv_scales) or checks its scales in
    attention, which a graph replay would skip: until it ran, no step replays a decode graph,
    a decode-shaped first step (one-token prompts) included."""
    model = make_tiny_model(tmp_path, "llama")
    llm = LLM(str(model), dtype="float32", device="cpu", kv_cache_memory=1 << 22,
              kv_cache_dtype="fp8", calculate_kv_scales=calculate)  # fmt: skip
    runner = llm.runner
    runner.graphs = SimpleNamespace(can_sample=True, can_run=lambda bs: bs <= SLOTS)
    assert runner.first_kv_pass == ("calculate" if calculate else "check")
    assert not runner._graph_decode(_decode_step(2))
    runner.graphs = None  # the step itself runs on CPU, eagerly
    llm.generate([[5], [9]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert runner.first_kv_pass is None
    runner.graphs = SimpleNamespace(can_sample=True, can_run=lambda bs: bs <= SLOTS)
    assert runner._graph_decode(_decode_step(2))
    runner.graphs = None
