"""The package's public functions: never shadowed by their submodules, and the core imports no torch."""

import subprocess
import sys


def test_public_functions_survive_importing_their_submodules():
    code = ("import llmem.compare, llmem.estimate, llmem.checkpointing, llmem.cli\n"
            "import llmem, types\n"
            "from llmem import compare, estimate, plan_checkpointing\n"
            "assert all(isinstance(f, types.FunctionType) for f in (compare, estimate, plan_checkpointing))\n"
            "assert isinstance(llmem.estimate, types.FunctionType)\n"
            "assert sys.modules['llmem.estimate'].estimate.__module__ == 'llmem.estimate'\n")
    subprocess.run([sys.executable, "-c", "import sys\n" + code], check=True)


def test_compare_passes_variants_through():
    from llmem import compare
    from llmem.compare import method_variants
    from llmem.plan import TrainingPlan
    from llmem.presets import load_preset
    from llmem.spec import ModelSpec

    spec = ModelSpec.from_config(load_preset("llama-3.2-1b-instruct"))
    plain = compare(spec, TrainingPlan(gpus=2), 80 * 2**30)
    with_lora = compare(spec, TrainingPlan(gpus=2), 80 * 2**30, variants=method_variants("lora"))
    assert len(with_lora.to_frame()) > len(plain.to_frame())


def test_the_core_imports_no_torch():
    code = ("import sys, llmem, llmem.estimate, llmem.compare, llmem.checkpointing, llmem.share, llmem.notes\n"
            "from llmem.presets import load_preset\nfrom llmem.spec import ModelSpec\n"
            "from llmem.plan import TrainingPlan\n"
            "llmem.estimate(ModelSpec.from_config(load_preset('llama-3.1-8b')), TrainingPlan(gpus=8, zero=3))\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
