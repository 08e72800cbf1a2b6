"""Everything from logits to token ids: the Sampler component.

rows.py      what a request needs from the sampler (RowClass, decided when it joins) and what
             a step's rows need together (StepRows): graph, sharding, run-ahead, kernel path
sampler.py   the Sampler: per-step sampling by that classification, state kept on the device
ops.py       the fused kernel's settings (SamplingTensors, SlotSettings) and its paths
host.py      the host path: forks, beams, logit controls (a SampleOutput per row)
penalties.py penalties, min_tokens masks and the penalty counts kept on the device
sharded.py   tensor-parallel sampling over vocabulary shards, without a gather
prompt_logprobs.py  prompt logprobs scored from a prefill step's own rows
rejection.py the exact rejection sampler of speculative decoding (not yet wired into the step)
output.py    StepHandle, SampleOutput, StepLogprobs, NonFiniteLogitsError
"""
