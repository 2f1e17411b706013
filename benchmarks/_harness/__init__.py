"""What the benchmark scripts share, one job per module (the scripts run as
``python benchmarks/X.py``, so ``benchmarks/`` is on ``sys.path``):

    netns         link shaping: network namespaces, a veth pair, ``tc`` rates
    launch        gloo ranks as processes (in the namespaces or on loopback), results back
    models        the model zoo (GPT, transformers Llama) by size, losses, fixed batches; the
                  one place the scripts build a model or a model config
    types         what the probes need of a runner (a protocol: no import back into runners)
    runners       step_time.py's modes: one mode's model and step, the comm-only replay
    steps         the rank worker loop: warm-up, then barrier-timed steps per repetition
    memory        memory probes: resident memory, a model's state, one step's peak
    trace         a step's link activity, threads' CPU time, profiler trace, collectives
    schedule_sim  a traced step's schedule replayed over a modelled link
    costmodel     the plugin's schedule records as cost-model input (gloo, FSDP2 on CPU)
    tables        summary statistics the tables print; gpu_check.py's Markdown tables
    gpu_models    gpu_check.py's model arithmetic: shapes, parameters, FLOPs, MFU
    profiling     gpu_check.py's compute profile: profiler rows, kinds, aggregation
    phases        gpu_check.py's phase processes: run with a time limit, results, junit
    code_order    gpu_check.py's code-order oracle: all-gathers in inductor's code
    torch_passes_phase  gpu_check.py's torch-passes phase: inductor's own distributed passes vs ours
"""
