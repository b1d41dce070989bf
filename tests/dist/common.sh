# The preamble of the dist check scripts, sourced once they have taken their own arguments (the
# rest: mpirun's command and, last, its process count flag): a fresh folder $dir, np (that flag),
# fail MESSAGE (exits 1) and field KEY FILE (a field of a one-line JSON file).
for flag; do np=$flag; done
rm -rf "$dir" && mkdir -p "$dir"
fail() { echo "FAIL: $*" >&2; exit 1; }
field() { sed -E "s/.*\"$1\": (\[[^]]*\]|[^,}]*).*/\1/" "$2"; }
