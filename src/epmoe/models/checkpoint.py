"""Reading a Hugging Face checkpoint directory tensor by tensor (where each family keeps its experts: ``layout``).

Only the tensors asked for are read (``safetensors`` memory-maps the files and ``get_slice`` reads one
expert out of a fused ``[E, ...]`` tensor), so a rank never materialises experts it does not hold.

Block-FP8 checkpoints (DeepSeek-V3/R1, Kimi-K2: ``quantization_config.quant_method: fp8``,
``weight_block_size: [128, 128]``) store a linear weight as ``float8_e4m3fn`` with a companion
``<name>_scale_inv [ceil(N/128), ceil(K/128)]`` float32; the reader hands out the dequantized tensor
(``weight[i, j] * scale_inv[i // 128, j // 128]``) and hides the companions from ``keys()``.
INT4 checkpoints in compressed-tensors' ``pack-quantized`` format (Kimi-K2/K2.5 routed experts) store a linear
``<module>.weight`` as ``<module>.weight_packed`` int32 ``[N, K/8]``, ``<module>.weight_scale`` ``[N, K/G]`` and
``<module>.weight_shape`` ``[2]``; MXFP4 checkpoints (gpt-oss) store a fused expert tensor ``<name>`` as
``<name>_blocks`` uint8 ``[E, N, K/32, 16]`` and ``<name>_scales`` uint8 ``[E, N, K/32]`` (``N`` the output
dimension). ``get`` hands out such tensors dequantized under their plain name, in the plain layout
(``<name>`` MXFP4 as ``[E, K, N]``, as transformers' modules hold it); ``get_int4`` and ``get_mxfp4`` hand them
out packed, as the expert-parallel loader keeps them (``read_expert_packed``).
Multimodal wrappers whose language model is under ``text_config`` (Kimi-K2.5) keep its tensors under
``language_model.``; the reader strips that prefix so names match the language model's own modules.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from epmoe.checks import read_text_file
from epmoe.experts.mxfp4 import E8M0_MAX_FINITE, E8M0_NAN
from epmoe.spec import fp8_block_size, int4_scheme_departure, language_model_config, read_config

SCALE_SUFFIX = "_scale_inv"
_WRAPPER_PREFIX = "language_model."
INT4_SUFFIXES = ("_packed", "_scale", "_shape")  # of "<module>.weight" in compressed-tensors' pack-quantized format
MXFP4_SUFFIXES = ("_blocks", "_scales")


@dataclass(frozen=True)
class Int4Tensor:
    """One INT4 pack-quantized weight as stored: ``packed [N, K/8]`` int32, ``scale [N, K/G]``, ``shape (N, K)``."""

    packed: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, int]

    @property
    def group_size(self) -> int:
        """``G``: inputs per scale."""
        return self.shape[1] // self.scale.shape[-1]

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` float32."""
        from epmoe.experts.int4 import dequantize_int4

        return dequantize_int4(self.packed, self.scale, self.group_size, torch.float32)


def _open(path: Path):
    """``safe_open`` of one weights file (its header read and checked against the file's size).

    Raises:
        ValueError: not a file, or the file cannot be read as safetensors (a damaged or truncated file), naming it.
    """
    if not path.is_file():
        raise ValueError(f"checkpoint file {path} is not a file (a directory or another kind): a weights file must be "
                         f"a safetensors file")
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:
        # the library's own words in double quotes: the CLI's flag names never rewrite inside them
        raise ValueError(f"checkpoint file {path} cannot be read as safetensors ({json.dumps(str(exc))}): it is "
                         f"damaged or incomplete; download it again") from None


def _index_weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a sharded checkpoint's ``model.safetensors.index.json``: tensor name -> shard file.

    Raises:
        ValueError: the file is not UTF-8 JSON (``checks.read_text_file``), not an object, or its ``weight_map`` is
            missing, not an object of file names, or names a file outside the checkpoint directory (an absolute
            path, or one through ``..``, which transformers refuses) or a directory (the file and the field named).
    """
    try:
        doc = json.loads(read_text_file(index, "checkpoint index"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"checkpoint index {str(index)!r} is not JSON ({exc})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if isinstance(doc, dict) and "weight_map" in doc and not isinstance(weight_map, dict):
        raise ValueError(f"checkpoint index {str(index)!r}: field 'weight_map' must be an object (tensor name -> "
                         f"shard file), got {json.dumps(weight_map)}")
    if not isinstance(weight_map, dict):
        found = f"its fields are {sorted(doc)}" if isinstance(doc, dict) else f"it holds a {type(doc).__name__}"
        raise ValueError(f"checkpoint index {str(index)!r} has no object 'weight_map' (tensor name -> shard file; "
                         f"{found})")
    bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
    if bad is not None:
        raise ValueError(f"checkpoint index {str(index)!r}: field 'weight_map' names no shard file for tensor "
                         f"{bad[0]!r} (got {bad[1]!r})")
    outside = next(((k, v) for k, v in weight_map.items() if Path(v).is_absolute() or ".." in Path(v).parts), None)
    if outside is not None:
        raise ValueError(f"checkpoint index {str(index)!r}: field 'weight_map' names shard file {outside[1]!r} for "
                         f"tensor {outside[0]!r}, outside the checkpoint directory (shards are named relative to it, "
                         f"without '..', as transformers reads them)")
    folder = next(((k, v) for k, v in weight_map.items() if v.endswith("/")), None)
    if folder is not None:
        raise ValueError(f"checkpoint index {str(index)!r}: field 'weight_map' names shard file {folder[1]!r} for "
                         f"tensor {folder[0]!r}, a directory's name (ending in '/')")
    return weight_map


def _shard_kind(index: Path, weight_map: dict[str, str], shard: str) -> str:
    """``"file"``, ``"missing"`` (a dangling link too) or ``"other"`` (a directory or another kind) for a shard the
    index names, beside the index.

    Raises:
        ValueError: the file system cannot look the name up (too long, a loop of links, a file where a directory is
            named, a NUL byte, no permission), with the index's field, the shard and a tensor it holds named.
    """
    try:
        st = os.stat(index.parent / shard)
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError) as exc:
        tensor = next(k for k, v in weight_map.items() if v == shard)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"checkpoint index {str(index)!r}: field 'weight_map' names shard file {shard!r} for tensor "
                         f"{tensor!r}, which the file system cannot look up: {why}") from None
    return "file" if stat.S_ISREG(st.st_mode) else "other"


def check_index_for_transformers(directory: str | Path) -> None:
    """What transformers' ``from_pretrained`` asks of a sharded checkpoint's index beyond what ``CheckpointReader``
    reads (it needs a ``metadata`` object), checked before the reference check is started, not after the run.

    Raises:
        ValueError: the index has no object ``metadata`` (the file and the field named).
    """
    index = Path(directory) / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        doc = json.loads(read_text_file(index, "checkpoint index"))
    except json.JSONDecodeError:
        return  # named by the reader (``_index_weight_map``)
    if isinstance(doc, dict) and not isinstance(doc.get("metadata"), dict):
        raise ValueError(f"checkpoint index {str(index)!r} has no object 'metadata', which transformers' "
                         f"from_pretrained reads for the reference check (--no-reference runs without it)")


class CheckpointReader:
    """Random access to the tensors of a local checkpoint (``model.safetensors`` or a sharded index).

    Args:
        directory: the checkpoint directory.

    Attributes:
        weight_map: full tensor name -> the shard file that holds it.
        unindexed: with an index, full tensor name -> a shard file the index names that holds that tensor though the
            index does not list it (named where the tensor is found missing); empty without an index.

    Raises:
        FileNotFoundError: no directory, no ``config.json``, or no safetensors weights in it.
        ValueError: an index file naming a shard that does not exist, or putting a tensor in a shard that does not
            hold it, or in one shard where another holds it too; a weights file that cannot be read (damaged or
            truncated: its header does not cover the file); 4-bit compressed-tensors weights in a scheme
            other than symmetric int groups, ``pack-quantized`` (the field named).
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {str(self.directory)!r} does not exist")
        if not (self.directory / "config.json").is_file():
            raise FileNotFoundError(f"checkpoint directory {str(self.directory)!r} has no config.json")
        index = self.directory / "model.safetensors.index.json"
        if index.exists():  # a pipe or a device there is refused by the reader, not taken for no index
            weight_map = _index_weight_map(index)
            kinds = {f: _shard_kind(index, weight_map, f) for f in sorted(set(weight_map.values()))}
            missing = [f for f, kind in kinds.items() if kind != "file"]
            odd = [f for f in missing if kinds[f] == "other"]
            if odd:
                raise ValueError(f"checkpoint {self.directory}: index names shard file {odd[0]!r}, which is not a file "
                                 f"(a directory or another kind)")
            if missing:
                raise ValueError(f"checkpoint {self.directory}: index names missing shard files {missing}")
            # every shard opened now (its header checked), so that a damaged one is named before anything runs
            handles = {f: _open(self.directory / f) for f in sorted(set(weight_map.values()))}
            held = {f: set(h.keys()) for f, h in handles.items()}
            astray = next(((k, f) for k, f in weight_map.items() if k not in held[f]), None)
            if astray is not None:
                raise ValueError(f"checkpoint index {str(index)!r}: field 'weight_map' puts tensor {astray[0]!r} in "
                                 f"shard file {astray[1]!r}, which does not hold it")
            twice = next(((k, f) for f, keys in held.items() for k in sorted(keys)
                          if k in weight_map and weight_map[k] != f), None)
            if twice is not None:  # transformers reads every shard named: the last copy would win there
                raise ValueError(f"checkpoint {self.directory}: tensor {twice[0]!r} is in both "
                                 f"{weight_map[twice[0]]!r} (where the index puts it) and {twice[1]!r}")
            unindexed = {k: f for f, keys in sorted(held.items()) for k in sorted(keys) if k not in weight_map}
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"checkpoint directory {str(self.directory)!r} has no *.safetensors weights")
            handles = {f.name: _open(f) for f in files}
            weight_map, unindexed = {}, {}
            for name, h in handles.items():
                for k in h.keys():
                    if k in weight_map:  # which one would be read is the files' order: a copy left beside the weights?
                        raise ValueError(f"checkpoint {self.directory}: tensor {k!r} is in both {weight_map[k]!r} "
                                         f"and {name!r} (with no model.safetensors.index.json to say which is read)")
                    weight_map[k] = name
        config = read_config(self.directory)[0]
        self.prefix = ""
        if isinstance(config.get("text_config"), dict) and any(k.startswith(_WRAPPER_PREFIX) for k in weight_map):
            self.prefix = _WRAPPER_PREFIX
        self.weight_map = weight_map
        self.unindexed = unindexed
        self.block_size = _block_size(config, self.directory)
        self.int4_group_size = _int4_group_size(config, self.directory)
        self._handles: dict[str, object] = handles
        # plain name -> its packed format, for tensors stored INT4 (``weight_packed``) or MXFP4 (``_blocks``)
        self._packed: dict[str, str] = {}
        for k in weight_map:
            if k.endswith(".weight_packed") and k[: -len("_packed")] not in weight_map:
                self._packed[k[: -len("_packed")]] = "int4"
            elif k.endswith("_blocks") and k[: -len("_blocks")] not in weight_map:
                self._packed[k[: -len("_blocks")]] = "mxfp4"
        self._companions = {base + suffix for base, fmt in self._packed.items()
                            for suffix in (INT4_SUFFIXES if fmt == "int4" else MXFP4_SUFFIXES)}

    def _handle(self, full_name: str):
        return self._handles[self.weight_map[full_name]]

    def __contains__(self, name: str) -> bool:
        return self.prefix + name in self.weight_map or self.prefix + name in self._packed

    def packed_format(self, name: str) -> str | None:
        """``int4`` or ``mxfp4`` when tensor ``name`` is stored packed in that format, else ``None``."""
        return self._packed.get(self.prefix + name)

    def stored_shape(self, name: str) -> tuple[int, ...]:
        """Shape of the stored tensor ``name`` (a packed format's own tensors by their names: ``..._blocks``,
        ``..._packed``) from the file headers.

        Raises:
            KeyError: the checkpoint has no tensor of that name (the directory is named).
        """
        full = self.prefix + name
        if full not in self.weight_map:
            raise KeyError(f"checkpoint {self.directory} has no tensor {name!r}")
        return tuple(self._handle(full).get_slice(full).get_shape())

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` as ``get`` returns it, from the file headers (no weight data read): a packed
        tensor's dequantized shape (INT4: its ``weight_shape`` values, else ``[N, 8 * words]``; MXFP4 fused
        expert tensors ``[..., N, K/32, 16]`` as ``[..., K, N]``).

        Raises:
            KeyError: the checkpoint has no tensor of that name (the directory is named).
        """
        full = self.prefix + name
        fmt = self._packed.get(full)
        if fmt == "int4":
            if full + "_shape" in self.weight_map:
                return tuple(int(v) for v in self._read(full + "_shape", None).tolist())
            n, words = self._handle(full + "_packed").get_slice(full + "_packed").get_shape()
            return (n, 8 * words)
        if fmt == "mxfp4":
            *lead, n, kb, _ = self._handle(full + "_blocks").get_slice(full + "_blocks").get_shape()
            return (*lead, 32 * kb, n)
        if full not in self.weight_map:
            raise KeyError(f"checkpoint {self.directory} has no tensor {name!r}")
        return tuple(self._handle(full).get_slice(full).get_shape())

    def dtype(self, name: str) -> str:
        """The dtype tensor ``name`` is stored in, as the file header names it (``BF16``, ``F32``, ``F8_E4M3``,
        ``I32``; no weight data read). A packed tensor has no plain dtype: ask ``check_int4`` / ``check_mxfp4``.

        Raises:
            KeyError: the checkpoint has no plain tensor of that name (the directory is named).
        """
        full = self.prefix + name
        if full not in self.weight_map:
            raise KeyError(f"checkpoint {self.directory} has no tensor {name!r}")
        return self._handle(full).get_slice(full).get_dtype()

    def keys(self) -> list[str]:
        """Names of the model tensors in the checkpoint (wrapper prefix stripped, packed tensors under their plain
        name, ``_scale_inv``, INT4 and MXFP4 companions and tensors outside the language model left out)."""
        n = len(self.prefix)
        names = [k for k in self.weight_map if not k.endswith(SCALE_SUFFIX) and k not in self._companions]
        return [k[n:] for k in names + list(self._packed) if k.startswith(self.prefix)]

    @property
    def has_packed(self) -> bool:
        """The checkpoint holds INT4 pack-quantized or MXFP4 tensors."""
        return bool(self._packed)

    @property
    def has_fp8(self) -> bool:
        """The checkpoint holds block-FP8 weights (at least one ``_scale_inv`` companion)."""
        return any(k.endswith(SCALE_SUFFIX) for k in self.weight_map)

    def get(self, name: str, index: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read tensor ``name`` (or only row ``index`` of its first dimension).

        A ``float8_e4m3fn`` tensor with a ``<name>_scale_inv`` companion comes back dequantized
        (``q[i, j] * scale_inv[i // B, j // B]``, ``B`` the block size of ``quantization_config``; ragged
        last blocks included); with ``index`` only that row of both is read.

        Args:
            name: tensor name as the language model's modules name it.
            index: row of the first dimension to read, or ``None`` for the whole tensor.
            dtype: dtype of the result; ``None`` keeps the stored dtype (float32 for dequantized FP8).

        An INT4 (``weight_packed``) or MXFP4 (``_blocks``) tensor comes back dequantized to float32 under its plain
        name; MXFP4 fused expert tensors ``[E, N, K/32, 16]`` as ``[E, K, N]`` (transformers' layout; with ``index``
        one expert's ``[K, N]``).

        Raises:
            KeyError: the checkpoint has no tensor of that name (the directory is named).
            ValueError: a float8 tensor without its ``_scale_inv`` companion, or a scale of the wrong
                shape; a packed tensor without its scales or with inconsistent shapes (the tensor is named).
        """
        full = self.prefix + name
        fmt = self._packed.get(full)
        if fmt == "int4":
            if index is None:
                tensor = self.get_int4(name).dequantize()
            else:  # one row: its packed words and scales
                one = self.get_int4(name, row=index)
                tensor = one.dequantize()[0]
            return tensor if dtype is None else tensor.to(dtype)
        if fmt == "mxfp4":
            from epmoe.experts.mxfp4 import dequantize_mxfp4

            blocks, scales = self.get_mxfp4(name, index)
            tensor = dequantize_mxfp4(blocks, scales, torch.float32).transpose(-1, -2).contiguous()
            return tensor if dtype is None else tensor.to(dtype)
        if full not in self.weight_map:
            raise KeyError(f"checkpoint {self.directory} has no tensor {name!r}")
        h = self._handle(full)
        tensor = h.get_tensor(full) if index is None else h.get_slice(full)[index]
        if tensor.dtype in _FLOAT8:
            scale_name = full + SCALE_SUFFIX
            if scale_name not in self.weight_map:
                raise ValueError(
                    f"checkpoint {self.directory}: tensor {full!r} is {tensor.dtype} but has no {scale_name!r} "
                    f"companion with its block scales; cannot dequantize it"
                )
            hs = self._handle(scale_name)
            what = f"checkpoint {self.directory}: tensor {full!r}"
            if index is None:
                tensor = dequantize_blockwise(tensor, hs.get_tensor(scale_name), self.block_size, what=what)
            elif tensor.dim() >= 2:  # one expert of a fused [E, N, K] tensor: its own [nb, kb] scales
                tensor = dequantize_blockwise(tensor, hs.get_slice(scale_name)[index], self.block_size, what=what)
            else:  # one row of a [N, K] weight: the scale row of its block
                row = hs.get_slice(scale_name)[index // self.block_size[0]]
                tensor = dequantize_blockwise(tensor[None], row[None], self.block_size, what=f"{what}[{index}]")[0]
            _refuse(~torch.isfinite(tensor), f"{what}{'' if index is None else f' (index {index})'} dequantized "
                                             f"with its {scale_name!r}")
        return tensor if dtype is None else tensor.to(dtype)

    def _companion(self, full: str, suffix: str, what: str) -> str:
        name = full + suffix
        if name not in self.weight_map:
            raise ValueError(f"checkpoint {self.directory}: tensor {full + what!r} has no {name!r} companion; "
                             f"cannot read the quantized weight {full!r} without it")
        return name

    def _read(self, full: str, index: int | None) -> torch.Tensor:
        h = self._handle(full)
        return h.get_tensor(full) if index is None else h.get_slice(full)[index]

    def get_fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the block-FP8 weight ``name`` as stored, not widened: ``(q [N, K] float8_e4m3fn, scale
        [ceil(N/128), ceil(K/128)] float32)`` (``scale`` its ``_scale_inv`` companion), after ``check_fp8``.

        Raises:
            KeyError, ValueError: as ``check_fp8``; NaN values, or scales that are not finite or that make the
                largest FP8 value infinite (the tensor and first position named).
        """
        scale_name = self.check_fp8(name)
        full = self.prefix + name
        q, scale = self._read(full, None), self._read(scale_name, None).float()
        where = f"checkpoint {self.directory}: tensor {full!r}"
        _refuse((q.view(torch.uint8) & 0x7F) == 0x7F, where)  # float8_e4m3fn's NaN codes; it has no infinity
        _refuse(~torch.isfinite(scale * FP8_E4M3_MAX), f"checkpoint {self.directory}: tensor {scale_name!r} (block "
                                                      f"scales, times the largest FP8 value {FP8_E4M3_MAX:g})")
        return q, scale

    def check_fp8(self, name: str) -> str:
        """Check the block-FP8 weight ``name`` from the file headers (no weight data read): a 2-d float8_e4m3fn
        tensor in 128x128 blocks (``quantization_config.weight_block_size``) with a float ``_scale_inv`` companion of
        ``[ceil(N/128), ceil(K/128)]``, the layout the FP8 expert kernels read. Returns the companion's full name.

        Raises:
            KeyError: no such tensor (the directory is named).
            ValueError: another dtype, shape or block size, or the companion missing or of another dtype or shape
                (each names the tensor).
        """
        from epmoe.experts.fp8 import FP8_BLOCK

        full = self.prefix + name
        if full not in self.weight_map:
            raise KeyError(f"checkpoint {self.directory} has no tensor {name!r}")
        where = f"checkpoint {self.directory}: tensor {full!r}"
        dtype, shape = self._handle(full).get_slice(full).get_dtype(), self.stored_shape(name)
        if dtype != "F8_E4M3" or len(shape) != 2:
            raise ValueError(f"{where} is {dtype} of shape {shape}; block-FP8 routed experts are served as stored, "
                             f"which takes 2-d F8_E4M3 (float8_e4m3fn) weights")
        if self.block_size != (FP8_BLOCK, FP8_BLOCK):
            raise ValueError(f"{where}: block-FP8 routed experts are served as stored in {FP8_BLOCK}x{FP8_BLOCK} "
                             f"blocks only, quantization_config.weight_block_size is {list(self.block_size)}")
        return self.check_fp8_scales(name)

    def check_fp8_scales(self, name: str) -> str:
        """Check from the file headers that the float8 tensor ``name`` (``[..., N, K]``) has the ``_scale_inv``
        companion its dequantization reads: a float tensor of ``[..., ceil(N/bn), ceil(K/bk)]`` in the config's
        ``bn x bk`` blocks. Returns the companion's full name.

        Raises:
            ValueError: the companion missing, or of another dtype or shape (each names the tensor).
        """
        full = self.prefix + name
        shape = self.stored_shape(name)
        scale_name = full + SCALE_SUFFIX
        if scale_name not in self.weight_map:
            header = self.dtype(name)
            dtype = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}.get(header, header)
            raise ValueError(f"checkpoint {self.directory}: tensor {full!r} is {dtype} but has no {scale_name!r} "
                             f"companion with its block scales")
        bn, bk = self.block_size
        want = block_scales_shape(shape, self.block_size)
        scale_dtype = self._handle(scale_name).get_slice(scale_name).get_dtype()
        scale_shape = self.stored_shape(name + SCALE_SUFFIX)
        if scale_dtype not in _FLOAT_HEADER_DTYPES or scale_shape != want:
            raise ValueError(f"checkpoint {self.directory}: tensor {scale_name!r} is {scale_dtype} of shape "
                             f"{scale_shape}, expected a float of shape {want} for the {tuple(shape)} weight in "
                             f"{bn}x{bk} blocks (quantization_config.weight_block_size)")
        return scale_name

    def get_int4(self, name: str, row: int | None = None, expect: tuple[int, int] | None = None) -> Int4Tensor:
        """Read the INT4 pack-quantized weight ``name`` (``<module>.weight``) as stored, not widened.

        Args:
            name: the plain name (``...gate_proj.weight``).
            row: read only this output row (``[1, K/8]`` / ``[1, K/G]``), or ``None`` for all.
            expect: ``(N, K)`` that config.json predicts, checked against ``weight_shape``.

        Raises:
            KeyError: no such tensor (the directory is named).
            ValueError: ``weight_scale`` or ``weight_shape`` missing, ``weight_shape`` not the ``expect``-ed
                shape, packed values / scales whose shapes do not fit it, or a NaN or infinite scale (each names the
                tensor).
        """
        n, k = self.check_int4(name, expect)
        full = self.prefix + name
        scale_name = self._companion(full, "_scale", "_packed")
        packed, scale = self._read(full + "_packed", row), self._read(scale_name, row)
        if row is not None:
            packed, scale = packed[None], scale[None]
        # times the largest |q| (8): a finite scale whose weights overflow float32 is no weight either
        _refuse(~torch.isfinite(scale.float() * 8), f"checkpoint {self.directory}: tensor {scale_name!r}"
                                                    f"{'' if row is None else f' (row {row})'} (times the largest "
                                                    f"4-bit value, 8)")
        return Int4Tensor(packed, scale, (n, k))

    def check_int4(self, name: str, expect: tuple[int, int] | None = None) -> tuple[int, int]:
        """Check the INT4 pack-quantized weight ``name`` from the file headers and its small ``weight_shape`` tensor
        (no weight data read): ``weight_shape`` is ``[N, K]`` (and ``expect`` when given), the packed values are
        ``[N, K/8]``, the scales ``[N, K/G]`` with ``G`` the config's ``group_size``. ``get_int4`` reads after
        these checks; ``models.hf.check_checkpoint`` makes them for every routed expert before anything is read.

        Returns:
            ``(N, K)``.

        Raises:
            KeyError: no such tensor (the directory is named).
            ValueError: as ``get_int4``, and packed values that are not int32 or scales that are not a float dtype.
        """
        full = self.prefix + name
        if self._packed.get(full) != "int4":
            raise KeyError(f"checkpoint {self.directory} has no INT4 pack-quantized tensor {name!r} "
                           f"({full}_packed)")
        scale_name = self._companion(full, "_scale", "_packed")
        shape_name = self._companion(full, "_shape", "_packed")
        stored = [int(v) for v in self._read(shape_name, None).reshape(-1).tolist()]
        if len(stored) != 2:
            raise ValueError(f"checkpoint {self.directory}: tensor {shape_name!r} holds {stored}, expected [N, K]")
        n, k = stored
        if expect is not None and (n, k) != tuple(expect):
            raise ValueError(f"checkpoint {self.directory}: tensor {shape_name!r} holds {(n, k)}, expected "
                             f"{tuple(expect)} from config.json (does config.json belong to these weights?)")
        packed_slice = self._handle(full + "_packed").get_slice(full + "_packed")
        scale_slice = self._handle(scale_name).get_slice(scale_name)
        if packed_slice.get_dtype() != "I32":
            raise ValueError(f"checkpoint {self.directory}: tensor {full + '_packed'!r} is {packed_slice.get_dtype()}, "
                             f"expected I32 (int32: eight 4-bit values a word)")
        if scale_slice.get_dtype() not in _FLOAT_HEADER_DTYPES:
            raise ValueError(f"checkpoint {self.directory}: tensor {scale_name!r} is {scale_slice.get_dtype()}, "
                             f"expected a float dtype ({', '.join(_FLOAT_HEADER_DTYPES)}) for the group scales")
        packed_shape, scale_shape = tuple(packed_slice.get_shape()), tuple(scale_slice.get_shape())
        if packed_shape != (n, -(-k // 8)):
            raise ValueError(f"checkpoint {self.directory}: tensor {full + '_packed'!r} has shape {packed_shape}, "
                             f"expected {(n, -(-k // 8))} for weight_shape {[n, k]}")
        if len(scale_shape) != 2 or scale_shape[0] != n or not scale_shape[1] or k % scale_shape[1]:
            raise ValueError(f"checkpoint {self.directory}: tensor {scale_name!r} has shape {scale_shape}, expected "
                             f"[{n}, {k} / group_size] for weight_shape {[n, k]}")
        group = k // scale_shape[1]
        if self.int4_group_size is not None and group != self.int4_group_size:
            raise ValueError(f"checkpoint {self.directory}: tensor {scale_name!r} has shape {scale_shape}: one scale "
                             f"per {group} inputs, but config.json's quantization_config gives group_size "
                             f"{self.int4_group_size}")
        return n, k

    def check_mxfp4(self, name: str) -> None:
        """Check the MXFP4 tensor ``name`` from the file headers (no weight data read): its ``_scales`` companion is
        there, both are uint8, the blocks ``[..., N, K/32, 16]`` and the scales ``[..., N, K/32]``. ``get_mxfp4`` reads
        after these checks; ``models.hf.check_checkpoint`` makes them for every routed expert tensor first.

        Raises:
            KeyError: no such tensor (the directory is named).
            ValueError: ``_scales`` missing, a dtype other than uint8, or shapes that do not fit (named).
        """
        full = self.prefix + name
        if self._packed.get(full) != "mxfp4":
            raise KeyError(f"checkpoint {self.directory} has no MXFP4 tensor {name!r} ({full}_blocks)")
        scales_name = self._companion(full, "_scales", "_blocks")
        blocks = self._handle(full + "_blocks").get_slice(full + "_blocks")
        scales = self._handle(scales_name).get_slice(scales_name)
        if blocks.get_dtype() != "U8" or scales.get_dtype() != "U8":
            raise ValueError(f"checkpoint {self.directory}: {full}_blocks / {scales_name} are {blocks.get_dtype()} / "
                             f"{scales.get_dtype()}, expected U8 / U8 (uint8: MXFP4 values and E8M0 scales)")
        b_shape, s_shape = tuple(blocks.get_shape()), tuple(scales.get_shape())
        if len(b_shape) < 2 or b_shape[-1] != 16:
            raise ValueError(f"checkpoint {self.directory}: tensor {full + '_blocks'!r} has shape {b_shape}; its last "
                             f"dimension must be 16 (the bytes of one block of 32 values)")
        if s_shape != b_shape[:-1]:
            raise ValueError(f"checkpoint {self.directory}: tensor {scales_name!r} has shape {s_shape}, expected "
                             f"{b_shape[:-1]} for {full + '_blocks'!r} of shape {b_shape} (one scale per 32 values)")

    def get_mxfp4(self, name: str, index: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the MXFP4 tensor ``name`` as stored: ``(<name>_blocks [..., N, K/32, 16] uint8, <name>_scales
        [..., N, K/32] uint8)``; with ``index`` only that entry of the first dimension (one expert).

        Raises:
            KeyError: no such tensor (the directory is named).
            ValueError: as ``check_mxfp4``; a scale of 255 (E8M0's NaN code; the tensor and the first such scale
                named).
        """
        self.check_mxfp4(name)
        full = self.prefix + name
        scales_name = full + "_scales"
        scales = self._read(scales_name, index)
        for bad, what in ((scales == E8M0_NAN, f"of {E8M0_NAN}, E8M0's NaN code,"),
                          (scales > E8M0_MAX_FINITE, f"above {E8M0_MAX_FINITE} (whose blocks' values, up to 6 x 2 ** "
                                                     f"(s - 127), overflow bf16 and float32),")):
            if bad.any():
                where = tuple(bad.nonzero()[0].tolist())
                count = int(bad.sum())
                raise ValueError(f"checkpoint {self.directory}: tensor {scales_name!r}"
                                 f"{'' if index is None else f' (expert {index})'} holds {count} "
                                 f"{'scale' if count == 1 else 'scales'} {what} the first at {where}"
                                 f"{'' if scales[where] == E8M0_NAN else f' ({int(scales[where])})'}: not an MXFP4 "
                                 f"block scale")
        return self._read(full + "_blocks", index), scales


FP8_E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value


def _refuse(bad: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` naming ``what``, the count and the first position of the NaN or infinite values that
    the bool tensor ``bad`` marks."""
    if bad.any():
        count = int(bad.sum())
        raise ValueError(f"{what} holds {count} NaN or infinite value{'s' if count > 1 else ''}, the first at "
                         f"{tuple(bad.nonzero()[0].tolist())}: not a weight")


_FLOAT8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}
_FLOAT_HEADER_DTYPES = ("BF16", "F16", "F32")  # safetensors header names of the scale dtypes the loaders take
# the header dtypes of the plain weights the loaders take: floats, and block FP8 (dequantized with its scales)
WEIGHT_HEADER_DTYPES = (*_FLOAT_HEADER_DTYPES, "F64", "F8_E4M3", "F8_E5M2")


def _int4_group_size(config: dict, directory: Path) -> int | None:
    """The ``group_size`` of the 4-bit weights of a compressed-tensors ``quantization_config`` (the language model's,
    else the top level's: ``spec.language_model_config``), ``None`` when there is none.

    Raises:
        ValueError: 4-bit weights in another scheme than symmetric int groups in the ``pack-quantized`` format
            (the field, its value and the file named).
    """
    qc = language_model_config(config).get("quantization_config") or {}
    where = f"{directory}/config.json: quantization_config"
    sizes = []
    for name, group in (qc.get("config_groups") or {}).items():  # every 4-bit group: one read wrongly is refused
        w = (group or {}).get("weights") or {}
        if w.get("num_bits") != 4:
            continue
        departure = int4_scheme_departure(qc, w, group)
        if departure is not None:
            path = f"config_groups.{name}.{departure.field}" if departure.in_group else departure.field
            raise ValueError(f"{where}.{path} is {json.dumps(departure.value)}; 4-bit weights are read with "
                             f"{departure.wanted} only")
        group_size = w.get("group_size")
        if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)):
            raise ValueError(f"{where}.config_groups.{name}.weights.group_size is {group_size!r}; expected an "
                             f"integer")
        sizes.append(group_size)
    return sizes[0] if sizes else None


def _block_size(config: dict, directory: Path) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` (the language model's, else the top level's;
    ``spec.fp8_block_size``)."""
    qc = language_model_config(config).get("quantization_config") or {}
    return fp8_block_size(qc, f"{directory}/config.json")


def block_scales_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The shape of the block scales of a ``[..., N, K]`` weight in ``bn x bk`` blocks: ``[..., ceil(N/bn),
    ceil(K/bk)]`` (a 1-d weight of ``N``: ``[ceil(N/bn)]``)."""
    bn, bk = block
    if len(shape) < 2:
        return (-(-shape[0] // bn),)
    return (*shape[:-2], -(-shape[-2] // bn), -(-shape[-1] // bk))


def dequantize_blockwise(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128), what: str = "tensor"
) -> torch.Tensor:
    """Dequantize a block-quantized weight.

    Args:
        q: ``[..., N, K]`` float8 values.
        scale: ``[..., ceil(N/bn), ceil(K/bk)]`` float32 per-block multipliers (``weight_scale_inv``).
        block: ``(bn, bk)`` block size.
        what: the tensor, as messages name it.

    Returns:
        ``[..., N, K]`` float32, ``q[..., i, j] * scale[..., i // bn, j // bk]``.

    Raises:
        ValueError: ``scale`` has the wrong shape (the tensor is named).
    """
    from epmoe.experts.fp8 import FP8_BLOCK, dequantize_block_fp8

    bn, bk = block
    n, k = q.shape[-2:]
    want = block_scales_shape(tuple(q.shape), block)
    if tuple(scale.shape) != want:
        raise ValueError(f"{what}: its block scales ({SCALE_SUFFIX}) have shape {tuple(scale.shape)}, expected "
                         f"{want} for a {tuple(q.shape)} weight in {bn}x{bk} blocks")
    if block == (FP8_BLOCK, FP8_BLOCK):
        lead = q.shape[:-2]
        out = dequantize_block_fp8(q.reshape(-1, n, k), scale.reshape(-1, *want[-2:]).float(), torch.float32)
        return out.reshape(*lead, n, k)
    full = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return q.float() * full
