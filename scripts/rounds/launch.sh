cd "$(dirname "$0")/../.."
python3 scripts/rounds/launch_probe.py 2>&1 | tee "$OUT/launch_probe.txt"
