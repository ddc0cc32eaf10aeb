"""The weight codec: the rollout's weights as a WeightSet, and each new version of them as the bytes of
an update.

A WeightSet maps HF parameter names (unfused q/k/v and gate/up; vLLM's loader fuses them) to tensors in
the rollout's format. For ``fp8-block128`` (and ``fp8-block128-pow2``) every linear weight inside the
transformer blocks ships as ``<module>.weight`` (float8_e4m3fn) plus ``<module>.weight_scale_inv``
(float32 block scales, powers of two under ``-pow2``, from :mod:`fp8rl.quant`); under a recipe with an
FP8 KV cache, each layer's ``self_attn.q_scale``, ``k_scale`` and ``v_scale`` (float32 scalars);
everything else, and every tensor of ``bf16``, in the high-precision dtype (bf16 unless a float32
exactness run asks for float32).

Two encodings, both sent as one or more *parts*, each part laid out as one safetensors file with string
metadata (its index and the number of parts; the last part seals the set with its digest). Parts cover
consecutive tensors, about 64 MiB of them each, so that a stream sends one part while the next is
encoded and its receiver applies one part while the next arrives:

* keyframe (``kind: full``): the whole set, with a digest per tensor.
* delta (``kind: delta``): each tensor whose bytes changed, as a uint8 tensor of packed chunks (16 MiB of
  the tensor each): an unchanged chunk packs to nothing, a sparse one to its changed words as (index
  gap, XOR) pairs with their bytes grouped by significance, a dense one to a stream of its XOR with the
  base, a new tensor's to a stream of its bytes (zstd throughout), each with the digest of its packed
  bytes; and the digest of each resulting tensor. A delta names its base version and the base set's
  digest, so it is only ever applied to exactly the bytes it was computed against.

Decoding verifies every digest before it returns, and an update is applied whole or not at all (parts are
applied as they arrive, and every part is put back if a later one fails). A delta against a set that owns
its memory (one the codec built or decoded) is applied in place: XORed into that memory (no second copy of
the set is made), and on any refusal XORed back, bit for bit (XOR is its own inverse).

Speed (bench/codec.py): every byte is hashed once, with XXH3-128 (integrity against corruption;
authenticity is the transport's job: TLS, and the trainer's Ed25519 signature of each update); a tensor's
digest is built from its chunks' digests and the set digest from the tensors'. An update is a list of
segments (its header, then each tensor's bytes, viewed, not copied) that the stream cuts into pieces; a
received buffer is decoded in place. Chunks are the unit of work on a thread pool (numpy, zstd and xxhash
release the GIL), so a big tensor keeps every core busy; within a chunk, deltas are computed in
cache-sized blocks.

The modules, lowest first (none imports one below it in this list):

* :mod:`~fp8rl.codec.weight_set`: ``WeightSet``, its digests, and the thread pool chunks run on.
* :mod:`~fp8rl.codec.schema`: which tensors the rollout holds, under which names; ``build_weight_set``.
* :mod:`~fp8rl.codec.layout`: an update's bytes: the safetensors layout, its sealed metadata, byte planes.
* :mod:`~fp8rl.codec.encode`: a set (or its changes against a base) as the parts of an update.
* :mod:`~fp8rl.codec.apply`: a delta's chunks applied to the held bytes, and XORed back on failure.
* :mod:`~fp8rl.codec.decode`: ``UpdateDecoder``: the parts of an update checked and applied, all or nothing.
* :mod:`~fp8rl.codec.segments`, :mod:`~fp8rl.codec.tcp_plane`: an update's parts as shared memory on one
  host, or over parallel TCP connections, beside its gRPC stream.
* :mod:`~fp8rl.codec.device_planes`: a set's tensors from device to device (NCCL or Gloo broadcast, CUDA
  IPC), shaped after vLLM's weight-transfer engines; torch alone.
* :mod:`~fp8rl.codec.stream`: an update as gRPC messages (``WeightHeader`` and data chunks).
* :mod:`~fp8rl.codec.testing`: whole updates in one call, for tests and benches; no service uses it.
"""
