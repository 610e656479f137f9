"""Fixed step-cost tables that tests inject (``cost_table=``) to run the default goodput policy
deterministically: its decisions then depend on the table and the acceptance seen, never on
this machine's timing."""

# Verifying more tokens is free and drafting costs nothing: the policy drafts up to the plan's
# K wherever a request's acceptance is above 0 (and re-probes a request that stopped paying).
FREE_VERIFY = {"batches": [1], "contexts": [1], "widths": [1, 2], "seconds": [[[0.01, 0.01]]],
               "draft_seconds_per_token": 0.0}
