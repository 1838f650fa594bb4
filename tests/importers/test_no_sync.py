"""`--no-sync` from a Trainer config: the HF Trainer accumulates under accelerate's no_sync unless
`accelerator_config.gradient_accumulation_kwargs.sync_each_batch` is true, and never under DeepSpeed; set only where
the merged plan takes it (several GPUs, data parallelism), else one ignored line with the reason."""

from llmem.importers import import_bytes, import_uploads

from .conftest import ignored, settings, used

FSDP2 = (b"per_device_train_batch_size: 2\ngradient_accumulation_steps: 4\nfsdp: full_shard\n"
         b"fsdp_config: {fsdp_version: 2}\n")


def test_trainer_accumulation_on_several_gpus_sets_no_sync():
    r = import_uploads([(FSDP2, "sft.yaml")], explicit={"gpus": 8})
    assert settings(r)["no_sync"] is True and settings(r)["zero"] == 3
    assert "no_sync" in used(r, "gradient_accumulation_steps")[-1].why


def test_sync_each_batch_true_turns_it_off():
    text = FSDP2 + b"accelerator_config: {gradient_accumulation_kwargs: {sync_each_batch: true}}\n"
    r = import_uploads([(text, "sft.yaml")], explicit={"gpus": 8})
    assert settings(r)["no_sync"] is False
    assert used(r, "accelerator_config.gradient_accumulation_kwargs.sync_each_batch")[0].why == \
        "every micro-step synchronizes"


def test_one_gpu_and_one_micro_step_leave_it_off_with_the_reason():
    r = import_bytes(b"per_device_train_batch_size: 2\ngradient_accumulation_steps: 4\n", "args.yaml")
    assert "no_sync" not in r.options
    assert "not applied: on one GPU" in ignored(r, "gradient_accumulation_steps").why
    r = import_uploads([(b"per_device_train_batch_size: 2\ngradient_accumulation_steps: 1\n", "args.yaml")],
                       explicit={"gpus": 8})
    assert "no_sync" not in r.options


def test_deepspeed_accumulates_itself():
    text = (b'{"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "deepspeed": '
            b'{"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}}}')
    r = import_uploads([(text, "args.json")], engine_torch=True, explicit={"gpus": 8})
    assert "no_sync" not in r.options
    assert "DeepSpeed accumulates by itself" in ignored(r, "gradient_accumulation_steps").why


def test_the_command_line_wins():
    r = import_uploads([(FSDP2, "sft.yaml")], explicit={"gpus": 8, "no_sync": False})
    assert "no_sync" not in r.options
    assert "--no-sync on the command line" in ignored(r, "gradient_accumulation_steps").why


def test_axolotl_and_llamafactory_run_the_trainer_loop():
    axolotl = b"micro_batch_size: 2\ngradient_accumulation_steps: 4\nsequence_len: 512\n"
    factory = b"per_device_train_batch_size: 2\ngradient_accumulation_steps: 4\ncutoff_len: 512\nstage: sft\n"
    for text, name in ((axolotl, "axolotl.yaml"), (factory, "llamafactory.yaml")):
        r = import_uploads([(text, name)], explicit={"gpus": 4})
        assert settings(r).get("no_sync") is True, (name, r.files, r.options)
