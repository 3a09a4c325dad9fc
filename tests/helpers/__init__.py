"""Test helpers shared by every test folder (on ``sys.path`` via ``pythonpath`` in pyproject).

- :mod:`helpers.service`: small batches, wire bodies, a real uvicorn process, plan equality.
- :mod:`helpers.deploy`: the deployment files parsed, their probe commands, the app's paths.
- :mod:`helpers.trees`: deep random trees, tree plans and the scored-loss gradient oracle.
- :mod:`helpers.shapes`: trainer-shaped batches at scale (GRPO groups) and the shape-fuzz strategies.
- :mod:`helpers.trainer_cases`: trainer batches, tiny HF models, per-sequence references.
- :mod:`helpers.ranks`: gloo ranks as real processes (spawn, join with a deadline, collect).
- :mod:`helpers.cp_oracle`: the context-parallel oracle (one rank's step against one process).
- :mod:`helpers.tolerance`: ``assert_close`` (fla style), the one tolerance helper.
- :mod:`helpers.extras`: optional test dependencies (skipped on a partial install, required under CI).
"""
