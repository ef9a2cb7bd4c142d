"""The user-facing entry point: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax

from infer.engine.engine import Engine, EngineConfig, check_speculation_devices
from infer.engine.request import RequestOutput
from infer.io.loader import load_on_host
from infer.io.tokenizer import Tokenizer
from infer.model.config import LlamaConfig
from infer.model.llama import Llama
from infer.parallel.flags import check_routing
from infer.parallel.mesh import ParallelConfig
from infer.parallel.placement import place_replicas
from infer.parallel.replicas import ReplicatedEngine
from infer.platform import enable_compilation_cache
from infer.sampling_params import SamplingParams
from infer.spec.config import SpeculativeConfig

# content: a string, or OpenAI text parts ([{"type": "text", "text": ...}])
Conversation = list[dict[str, str | list[dict[str, str]]]]


def _speculative(spec: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
    """`speculative` as LLM takes it: a SpeculativeConfig, or its fields as a dict (empty:
    none)."""
    if spec is None or isinstance(spec, SpeculativeConfig):
        return spec
    if isinstance(spec, dict):
        return SpeculativeConfig(**spec) if spec else None
    raise TypeError(f"speculative must be a SpeculativeConfig or a dict of its fields, got "
                    f"{type(spec).__name__}")


def _use_compilation_cache(on: bool) -> None:
    """LLM's `compilation_cache`: on, unless the process already chose a directory."""
    if on and not jax.config.jax_compilation_cache_dir:
        enable_compilation_cache()


class LLM:
    """Loads a model and serves it with the engine. Arguments as in vLLM where they overlap:

    model: a bundled preset ("smollm2-135m"), a GGUF file or a HF directory.
    dtype: weights, "float32" or "bfloat16". kv_cache_dtype: "auto" (the weights' dtype) or a
    KV format (float32, bfloat16, float16, float8_e4m3fn, float8_e5m2, int8, int4, int4_kivi;
    int4_kivi with the reference attention backend only, best at page_size=32).
    scheduler: "continuous" or "static". attention_backend: "reference" or "pallas".

    Past one device (`infer.parallel`): tensor_parallel_size T splits heads, the FFN and the
    vocabulary over T devices of one mesh (pad_heads=True allows a T that does not divide the
    heads, with zero heads); data_parallel_size D runs D such engine replicas, requests routed
    by `dp_routing` ("least_loaded" or "prefix"). T x D devices in all.

    Compilation: each program (a decode batch size, a prefill chunk size, per attention window)
    compiles at its first use, inside the call that needs it, and says so in one `infer:` log
    line. `compilation_cache` (on unless the process already chose a directory) keeps compiled
    programs on disk (`infer.platform.enable_compilation_cache`), so a later process loads them;
    `warmup=True` compiles every program here instead, with a progress bar.
    """

    def __init__(self, model: str = "smollm2-135m", dtype: str = "float32",
                 kv_cache_dtype: str = "auto", page_size: int = 16, max_num_seqs: int = 32,
                 scheduler: str = "continuous", enable_prefix_caching: bool = False,
                 attention_backend: str = "reference",
                 speculative: SpeculativeConfig | dict | None = None,
                 max_model_len: int = 2048, max_prefill_tokens: int = 256,
                 num_pages: int | None = None, static_max_wait_s: float = math.inf,
                 mixed_steps: bool = False, tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1, pad_heads: bool = False,
                 dp_routing: str = "least_loaded", compilation_cache: bool = True,
                 warmup: bool = False) -> None:
        _use_compilation_cache(compilation_cache)
        parallel = ParallelConfig(tensor_parallel_size, data_parallel_size, pad_heads)
        parallel.replica_meshes()  # too few devices fails before the checkpoint is read
        # So does a bad engine setting: the read takes seconds, a large GGUF's minutes.
        engine_config = EngineConfig(
            kv_cache_dtype=kv_cache_dtype, page_size=page_size, max_num_seqs=max_num_seqs,
            max_prefill_tokens=max_prefill_tokens, max_model_len=max_model_len,
            num_pages=num_pages, scheduler=scheduler, static_max_wait_s=static_max_wait_s,
            attention_backend=attention_backend, enable_prefix_caching=enable_prefix_caching,
            mixed_steps=mixed_steps, speculative=_speculative(speculative))
        check_routing(dp_routing, enable_prefix_caching)
        check_speculation_devices(engine_config, parallel.tensor_parallel_size)

        def fits(model_config: LlamaConfig) -> None:  # before the weights are read
            engine_config.check_model(model_config)
            parallel.check_model(model_config)

        config, host_model, tokenizer = load_on_host(model, dtype, fits)
        self._serve(config, host_model, tokenizer, engine_config, parallel, dp_routing, warmup)

    def _serve(self, config: LlamaConfig, model: Llama, tokenizer: Tokenizer,
               engine_config: EngineConfig, parallel: ParallelConfig, dp_routing: str,
               warmup: bool) -> None:
        """Places the model (one replica per data-parallel group) and builds the engine(s);
        with `warmup`, compiles every program they can run, with a progress bar."""
        self.config, self.tokenizer = config, tokenizer
        replicas = place_replicas(model, parallel)
        engines = [Engine(m, tokenizer, engine_config, mesh=mesh) for m, mesh in replicas]
        # As the first engine runs it: with tensor parallelism its heads as laid out, on one CPU
        # its projections maybe in the kernel's tile layout (`Engine`).
        self.model = engines[0].model
        self.engine: Engine | ReplicatedEngine = (
            engines[0] if len(engines) == 1 else ReplicatedEngine(engines, dp_routing))
        if warmup:
            self.engine.warmup(progress=True)

    @classmethod
    def from_loaded(cls, config: LlamaConfig, model: Llama, tokenizer: Tokenizer,
                    tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                    pad_heads: bool = False, dp_routing: str = "least_loaded",
                    compilation_cache: bool = True, warmup: bool = False,
                    **engine: object) -> "LLM":
        """An LLM over an already loaded model (from `infer.load`); `engine` takes the
        EngineConfig fields, the other arguments are `LLM`'s."""
        _use_compilation_cache(compilation_cache)
        llm = cls.__new__(cls)
        spec = _speculative(engine.pop("speculative", None))
        engine_config = EngineConfig(**engine, speculative=spec)
        check_routing(dp_routing, engine_config.enable_prefix_caching)
        llm._serve(config, model, tokenizer, engine_config,
                   ParallelConfig(tensor_parallel_size, data_parallel_size, pad_heads),
                   dp_routing, warmup)
        return llm

    def reset_prefix_cache(self) -> bool:
        """Drops every cached page that no request holds (vLLM's): True when the prefix cache
        is left empty (or there is none)."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in the order of the prompts. All requests
        are validated before any is queued."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        n = len(prompts) if prompts is not None else len(prompt_token_ids)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * n
        if len(sampling_params) != n:
            raise ValueError(f"{len(sampling_params)} sampling params for {n} prompts")
        for i, sp in enumerate(sampling_params):
            if not isinstance(sp, SamplingParams):  # before dataclasses.replace, which raises
                raise ValueError(f"prompt {i}: sampling params must be SamplingParams, got "
                                 f"{type(sp).__name__}")
        # Only finished outputs are returned: none is built (or its text decoded) per token.
        sampling_params = [dataclasses.replace(sp, output_kind="final") for sp in sampling_params]
        inputs = ([dict(prompt=p) for p in prompts] if prompts is not None
                  else [dict(prompt_token_ids=ids) for ids in prompt_token_ids])
        # All or nothing: every request is made (tokenized and validated, once) before any is
        # queued, so a bad prompt late in the batch leaves nothing behind.
        requests = []
        for i, (kw, sp) in enumerate(zip(inputs, sampling_params)):
            try:
                requests.append(self.engine.make_request(params=sp, **kw))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        ids = [self.engine.submit(r) for r in requests]
        # The engine runs every request it holds (ones added with add_request too): only
        # this call's are collected and counted.
        mine = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=n, desc="requests")
        try:
            for out in self.engine.stream():
                if out.finished and out.request_id in mine:
                    finished[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        except BaseException:
            # Stopped midway (Ctrl-C, an error): this call's requests leave the engine, which
            # would otherwise run them in the next call too.
            for request_id in ids:
                if request_id not in finished:
                    self.engine.abort(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Each conversation rendered with the model's chat template and generated from; each
        output's prompt is the rendered text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(list(c)) for c in conversations]
        # The template writes the special tokens its format has (a BOS or none): nothing is
        # added, as HF's apply_chat_template(tokenize=True) and vLLM's chat do.
        ids = [self.tokenizer.encode(p, add_bos=False) for p in prompts]
        outputs = self.generate(sampling_params=sampling_params, prompt_token_ids=ids,
                                use_tqdm=use_tqdm)
        return [dataclasses.replace(out, prompt=p) for out, p in zip(outputs, prompts)]
