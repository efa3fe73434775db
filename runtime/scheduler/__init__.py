"""What runs in the `ringserve::scheduler` process: its entry point (main.py), its loop
(process.py) around the transport-free scheduling core (core.py, told config.py's
SchedulerConfig, returning step_result.py's StepResult), the TOKEN_OUT records of a step
(token_out.py), the queue policy, prompt logprobs, speculative decoding, grammars and the
model runner it drives; traced.py: the loop with first-token stamps. The request table and
the radix prefix cache are gpu/kvcache/'s."""
