# Sourced by the GPT benchmarks: Tessera's default settings as a user gets them (no
# allocator variables, no launcher environment inherited, one OpenMP thread per rank),
# a scratch directory removed on exit, and an empty rows file.
#   bench_run_env NAME  -> sets TMP (/tmp/tessera-NAME-XXXXXX) and ROWS ($TMP/rows)
bench_run_env() {
  export OMP_NUM_THREADS=1
  unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT TESSERA_LAUNCHED \
    TESSERA_CPU_ALLOCATOR TESSERA_CPU_CACHE_MIB || true
  TMP=$(mktemp -d "/tmp/tessera-$1-XXXXXX")
  trap 'rm -rf "$TMP"' EXIT
  ROWS="$TMP/rows"
  : > "$ROWS"
}
