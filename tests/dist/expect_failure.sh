#!/bin/sh
# expect_failure.sh PATTERN... -- COMMAND...: runs COMMAND and passes when it exits non-zero, its
# output (stdout and stderr) matches every extended regular expression PATTERN, and no sanitizer
# reported an error (the failure must be the expected one).
patterns=""
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
  patterns="$patterns
$1"
  shift
done
shift
output=$("$@" 2>&1)
status=$?
printf '%s\n' "$output"
if [ "$status" -eq 0 ]; then
  echo "expect_failure: FAILED: the command exited with status 0 (expected a failure)"
  exit 1
fi
echo "expect_failure: the command exited with status $status"
if printf '%s\n' "$output" | grep -Eq -- "ERROR: [A-Za-z]+Sanitizer|WARNING: ThreadSanitizer|runtime error:"; then
  echo "expect_failure: FAILED: a sanitizer reported an error"
  exit 1
fi
printf '%s\n' "$patterns" | while IFS= read -r pattern; do
  [ -z "$pattern" ] && continue
  if ! printf '%s\n' "$output" | grep -Eq -- "$pattern"; then
    echo "expect_failure: FAILED: no output line matches '$pattern'"
    exit 1
  fi
done
