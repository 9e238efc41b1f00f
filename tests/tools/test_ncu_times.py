"""scripts/ncu-times on a small Nsight Compute raw CSV: steps, per-kernel sums, names, the sequence file."""
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "ncu-times")

HEADER = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",' \
         '"Device","CC","gpu__time_duration.sum"'
UNITS = '"","","","","","","","","","","","nsecond"'


def row(i, name, ns, grid="(16, 1, 1)"):
    return f'"{i}","1","bench","host","{name}","1","7","(128, 1, 1)","{grid}","0","9.0","{ns}"'


def run(tmp_path, lines, *args):
    path = tmp_path / "times.csv"
    path.write_text("\n".join(lines) + "\n")
    return subprocess.run([sys.executable, SCRIPT, str(path), *args], capture_output=True, text=True)


def test_steps_sums_names_and_sequence(tmp_path):
    gemm = "void lmx::cuda::(anonymous namespace)::grouped_gemm_kernel<16, 64, 1, 4, 6, true>(lmx::P)"
    flash = "void lmx::<unnamed>::flash_attention_kernel<(int)64, (int)4, 2, 1>(lmx::F)"
    lines = ["==PROF== Connected to process 1", "decode step, adapters spread   11.4 ms", HEADER, UNITS]
    for step in range(2):  # two steps of three kernels; the bench's own output interleaves
        lines += [row(3 * step, gemm, "200,000", "(34, 90, 1)"), row(3 * step + 1, flash, "9,000"),
                  row(3 * step + 2, "nvjet_sm90_tst_64x16_64x16_4x1_v_bz_TNT", "11,000")]
    sequence = tmp_path / "sequence.txt"
    result = run(tmp_path, lines, "--steps", "2", "--sequence", str(sequence))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "6 kernels in 2 step(s); kernels per step 3.0; sum of kernel times per step 220.0 us" in out
    assert "grouped_gemm_kernel" in out and "flash_attention_kernel" in out
    assert "<" not in out and "anonymous" not in out  # template arguments and namespaces dropped
    gemm_line = next(line for line in out.splitlines() if line.startswith("grouped_gemm_kernel"))
    assert gemm_line.split()[1:] == ["1.0", "200.0", "90.9%", "200.00"]
    order = sequence.read_text().splitlines()
    assert len(order) == 3  # the last step, in launch order
    assert "200.00 us" in order[0] and "(34, 90, 1)" in order[0] and "grouped_gemm_kernel<16" in order[0]


def test_units_in_microseconds_and_missing_columns(tmp_path):
    lines = [HEADER, UNITS.replace("nsecond", "usecond"), row(0, "k", "5.5"), row(1, "k", "4.5")]
    result = run(tmp_path, lines, "--steps", "1")
    assert result.returncode == 0, result.stderr
    assert "sum of kernel times per step 10.0 us" in result.stdout
    bad = run(tmp_path, ['"ID","Kernel Name"', '"0","k"'])
    assert bad.returncode != 0 and "gpu__time_duration.sum" in bad.stderr
