
import json, os, sys, time
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    job = json.load(open(sys.argv[1]))
    llm = LLM(model=job["model"], dtype="float32", enable_prefix_caching=True, max_model_len=4096, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=job["new"], ignore_eos=True)
    results = {}
    for name, prompts in job["workloads"].items():
        llm.reset_prefix_cache()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["warmup"]], params, use_tqdm=False)
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        results[name] = {"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]}
    json.dump(results, open(sys.argv[2], "w"))
