"""Command line: generate text from one prompt and print the measured speed.

  python -m infer.cli --model=smollm2-135m --prompt="Tell me about Paris" --chat

Past one device: --tensor_parallel_size=3 (on CPU with
XLA_FLAGS=--xla_force_host_platform_device_count=3 for three virtual devices). Across hosts, the
same command on each with --coordinator_address=HOST0:PORT --num_processes=N --process_id=i:
process 0 prints the text, the others run its steps.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

import infer.parallel.flags
from infer.parallel.flags import define_distributed_flags, define_parallel_flags, parallel_kwargs

flags.DEFINE_string("model", "smollm2-135m", "bundled preset, GGUF file or HF directory")
flags.DEFINE_string("prompt", None, "the prompt text", required=True)
flags.DEFINE_bool("chat", False, "wrap the prompt as a user turn in the model's chat template")
flags.DEFINE_integer("max_tokens", 128, "tokens to generate at most")
flags.DEFINE_float("temperature", 0.0, "0 is greedy")
flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass (1 disables)")
flags.DEFINE_integer("top_k", 0, "top-k sampling (0 disables)")
flags.DEFINE_integer("seed", None, "PRNG seed of the sampler (default: a fresh one, printed)")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "weight dtype")
flags.DEFINE_bool("ignore_eos", False, "keep generating past the end-of-sequence token")
flags.DEFINE_bool("enable_prefix_caching", False, "reuse KV pages of shared prompt prefixes "
                  "(what --dp_routing=prefix routes by)")
define_parallel_flags()
define_distributed_flags()
# Defined in infer.parallel.flags, so absl's --help would leave them to --helpfull.
flags.adopt_module_key_flags(infer.parallel.flags)


def main(argv: list[str]) -> None:
    del argv
    f = flags.FLAGS
    from infer.parallel import distributed
    if f.coordinator_address:  # before anything touches a device
        distributed.initialize(f.coordinator_address, f.num_processes, f.process_id)
    from infer.platform import configure_xla_cpu, enable_compilation_cache
    configure_xla_cpu()
    enable_compilation_cache()
    from infer import LLM, SamplingParams

    llm = LLM(model=f.model, dtype=f.dtype, max_num_seqs=1,
              enable_prefix_caching=f.enable_prefix_caching, **parallel_kwargs())
    params = SamplingParams(temperature=f.temperature, top_p=f.top_p, top_k=f.top_k,
                            max_tokens=f.max_tokens, seed=f.seed, ignore_eos=f.ignore_eos)
    generate = (lambda llm: llm.chat([{"role": "user", "content": f.prompt}], params)) if f.chat \
        else (lambda llm: llm.generate(f.prompt, params))

    def timed(llm: LLM) -> tuple:
        generate(llm)  # the first call compiles; time the second
        # ... from scratch: a prompt the cache held would take a shorter chunk (a program the
        # first call did not compile) and report a cache hit's time to first token.
        llm.reset_prefix_cache()
        start = time.perf_counter()
        return generate(llm)[0], time.perf_counter() - start

    result = distributed.run(llm, timed)
    if result is None:  # a following process: process 0 prints
        return
    out, elapsed = result
    print(out.text)
    m = out.metrics
    decode_rate = (1 / m.tpot_s) if m.tpot_s else float("nan")
    print(f"\n[{m.num_prompt_tokens} prompt tokens, {m.num_output_tokens} generated in "
          f"{elapsed:.2f} s; TTFT {m.ttft_s * 1e3:.0f} ms; decode {decode_rate:.1f} tokens/s"
          f"{f'; seed {out.seed}' if f.temperature > 0 else ''}]",
          file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
