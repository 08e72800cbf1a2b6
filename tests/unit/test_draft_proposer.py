"""DraftProposer: its drafts are the draft model's greedy continuation, its K/V is reused for
the tokens the target accepted and rolled back past the first rejected draft, and freeing a
sequence gives every block back."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from nanopaged import LLM, SamplingParams
from nanopaged.config import EngineConfig, ModelConfig
from nanopaged.spec.config import SpeculativeConfig
from nanopaged.spec.draft import DraftProposer

K = 4
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3]  # 18 tokens: two blocks of 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("draft-unit"), "llama", vocab_size=32)


def proposer_of(path, max_num_batched_tokens: int = 64) -> DraftProposer:
    spec = SpeculativeConfig("draft_model", K, model=str(path))
    config = EngineConfig(kv_cache_memory=1 << 22, speculative_config=spec,
                          max_num_batched_tokens=max_num_batched_tokens)  # fmt: skip
    target = ModelConfig.from_dir(path, None, None)
    draft, target_config = DraftProposer.start(
        spec, config, target, 128, torch.device("cpu"), torch.float32, False, torch.float32,
        "auto",
    )  # fmt: skip
    # Both models are the same here: the budget is halved between them.
    assert target_config.kv_cache_memory == (1 << 22) // 2
    return draft


def count_forwarded(draft: DraftProposer) -> list[int]:
    """Record the tokens each of the draft's forward passes computes."""
    counts: list[int] = []
    execute = draft.runner.execute

    def counting(step, prev):
        counts.append(len(step.input_ids))
        return execute(step, prev)

    draft.runner.execute = counting
    return counts


@pytest.mark.parametrize("budget", [64, 8])
def test_drafts_are_the_greedy_continuation(model, budget):
    greedy = LLM(str(model), dtype="float32", max_model_len=128).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=K, ignore_eos=True), use_tqdm=False
    )[0].outputs[0].token_ids
    draft = proposer_of(model, budget)
    counts = count_forwarded(draft)
    assert draft.propose([PROMPT], [7]) == [list(greedy)]
    # Catch-up in chunks of at most the budget (the last token left for the drafting pass),
    # then k - 1 one-token passes.
    assert sum(counts) == len(PROMPT) + K - 1 and max(counts) <= budget
    assert counts[-(K - 1):] == [1] * (K - 1)


def test_kv_reused_up_to_the_first_rejected_draft(model):
    draft = proposer_of(model)
    [drafts] = draft.propose([PROMPT], [7])
    bm = draft.block_manager
    counts = count_forwarded(draft)
    # The target accepted two drafts and corrected the third.
    wrong = (drafts[2] + 1) % 32
    tokens = PROMPT + drafts[:2] + [wrong]
    [again] = draft.propose([tokens], [7])
    # Only the correction is new to the draft's cache, then k - 1 one-token passes.
    assert counts == [1] + [1] * (K - 1)
    seq, checked = draft._seqs[7]
    assert checked == len(tokens) and seq.num_computed_tokens == len(tokens) + K - 1
    assert len(seq.block_table) == bm.num_blocks_for(len(tokens) + K - 1)
    assert again == proposer_of(model).propose([tokens], [8])[0]  # as from scratch
    draft.free(7)
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_all_rejected_rolls_back_without_leaking(model):
    draft = proposer_of(model)
    prompt = PROMPT[:14]  # the k - 1 drafts' K/V spill into a second block
    [drafts] = draft.propose([prompt], [7])
    seq, _ = draft._seqs[7]
    assert len(seq.block_table) == 2
    bm = draft.block_manager
    used = bm.num_used_blocks
    # Every draft rejected: the target's correction alone follows the prompt; the slots of the
    # rejected drafts are trimmed and written again.
    tokens = prompt + [(drafts[0] + 1) % 32]
    [again] = draft.propose([tokens], [7])
    assert seq.num_computed_tokens == len(tokens) + K - 1
    assert bm.num_used_blocks == used
    assert again == proposer_of(model).propose([tokens], [8])[0]  # as from scratch
    draft.free_all()
    assert bm.num_free_blocks == bm.num_blocks
