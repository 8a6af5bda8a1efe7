"""Post-training on dispersed compute: GRPO with untrusted rollout workers and verified rollouts.

The library takes built objects (a model, a tokenizer, a codec, an optimizer step): tasks with
verifiers (:mod:`.tasks`), the base-model recipe (:mod:`.base`), seeded sampling with
commitments (:mod:`.policy`), the check of a claimed rollout (:mod:`.verify`), GRPO's objective
(:mod:`.grpo`), policy versions out as compressed deltas (:mod:`.broadcast`), the job board
(:mod:`.board`), the trainer (:mod:`.trainer`), workers (:mod:`.workers`) and a replica group's
loop with worker threads (:mod:`.loop`). ``farlink rl`` and ``farlink bench rl`` build them.
"""
