"""Structured outputs: constrained decoding by grammars (JSON schemas, regexes, EBNF,
structural tags).

A request's constraint (`constraint.Constraint`, from its sampling params) is compiled off the
loop by a `compiler.GrammarCompiler` (a bounded thread pool and a byte-capped cache over a
backend: xgrammar or llguidance, `--grammar-backend`, made by `registry`); the request waits
for it outside the core, so it holds no slot. Each admitted request then owns a
`backend.Matcher`: the loop accepts every committed token into it, and before a step
samples, a `step_mask.StepMask` carries the allowed-token bitmask of each constrained row
to the sampler. Under overlap, a
row whose previous token is still in flight gets its mask once that token is accepted; the
forward does not wait for it, only the sampling of that step does (SGLang's delayed
sampling).

The package root imports nothing, so the torch-free request types can use
`rsgl.grammar.constraint`; the loop (`rsgl.scheduler`) drives the rest, and the sampler
(`rsgl.layers`) only reads the masks.
"""
