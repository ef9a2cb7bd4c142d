"""One process of the two-process test (tests/parallel/test_multihost.py): two virtual CPU
devices each, one tensor-parallel mesh of four over both; process 0 prints JSON with the tokens
of the distributed run and of one local device."""

from __future__ import annotations

import json
import sys


def main(process_id: int, port: int) -> None:
    from infer.parallel import distributed
    distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                           local_device_count=2)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from infer.llm import LLM
    from infer.model.llama import Llama
    from infer.platform import enable_compilation_cache
    from infer.sampling_params import SamplingParams
    from tests.parallel.test_tensor_parallel import GROUPED as config  # 6/3 heads: padded to 8/4
    model = Llama(config, jnp.float32, nnx.Rngs(5))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, int(n)).tolist() for n in (5, 13, 3)]
    # Sampled (tests/parallel/test_tensor_parallel.py says why they still compare exactly).
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    engine = dict(max_num_seqs=2, max_model_len=64, max_prefill_tokens=16)
    # As the CLI and LLM(...) ask for it: on, the processes' collectives disagreed.
    cache = enable_compilation_cache(sys.argv[3] if len(sys.argv) > 3 else None)
    llm = LLM.from_loaded(config, model, None, tensor_parallel_size=4, pad_heads=True, **engine)
    mesh_devices = llm.engine.runner.device_steps.mesh.devices.size

    def generate(llm: LLM) -> list[list[int]]:
        llm.engine.warmup()
        return [o.token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                  sampling_params=params)]

    tokens = distributed.run(llm, generate)
    if process_id == 0:
        one = LLM.from_loaded(config, model, None, **engine)
        expected = [o.token_ids for o in one.generate(prompt_token_ids=prompts,
                                                      sampling_params=params)]
        print(json.dumps({"tokens": tokens, "one_device": expected,
                          "global_devices": jax.device_count(), "mesh_devices": mesh_devices,
                          "processes": jax.process_count(), "cache": cache,
                          "cache_dir": jax.config.jax_compilation_cache_dir}), flush=True)
    else:
        assert tokens is None


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
