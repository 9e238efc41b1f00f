"""scripts/sass-loops on a small SASS text: loop bodies found from backward branches, the --must filter,
--kernel matching and --per division."""
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "sass-loops")


def line(address, text):
    return f"        /*{address:04x}*/                   {text} ;   /* 0x000000000000000000000000000000 */"


def sass():
    rows = ["\tcode for sm_90a", "\t\tFunction : _Z6kernelILi64EEv", "\t.headerflags\t@\"EF_CUDA_SM90\""]
    rows += [line(0x00, "MOV R1, c[0x0][0x28]"), line(0x10, "S2R R0, SR_TID.X")]
    # loop 1 (0x20-0x70): two HMMA, an LDS, a predicated LDS, the branch back
    rows += [line(0x20, "LDS.64 R12, [R5]"), line(0x30, "HMMA.16816.F32.BF16 R20, R28, R42, R20"),
             line(0x40, "HMMA.16816.F32.BF16 R24, R28, R40, R24"), line(0x50, "@!PT LDS RZ, [RZ]"),
             line(0x60, "ISETP.GE.AND P0, PT, R8, R9, PT"), line(0x70, "@!P0 BRA 0x20")]
    # loop 2 (0x80-0xa0): no HMMA (an epilogue loop)
    rows += [line(0x80, "FADD R1, R1, R2"), line(0x90, "ISETP.GE.AND P0, PT, R8, R9, PT"), line(0xA0, "@!P0 BRA 0x80")]
    rows += [line(0xB0, "BRA 0xc0"), line(0xC0, "EXIT")]
    rows += ["\t\tFunction : _Z5otherv", line(0x00, "EXIT")]
    return "\n".join(rows) + "\n"


def run(tmp_path, *args):
    path = tmp_path / "k.sass"
    path.write_text(sass())
    return subprocess.run([sys.executable, SCRIPT, "--sass", str(path), *args], capture_output=True, text=True)


def test_mma_loop_counted_and_epilogue_loop_skipped(tmp_path):
    r = run(tmp_path, "--kernel", "ILi64E")
    assert r.returncode == 0, r.stderr
    assert "_Z6kernelILi64EEv: 13 instructions" in r.stdout
    assert "_Z5otherv" not in r.stdout
    loops = [l for l in r.stdout.splitlines() if "loop" in l]
    assert len(loops) == 1 and "loop 0x20-0x70: 6 instructions" in loops[0]
    assert "HMMA.16816.F32.BF16 2" in loops[0] and "LDS 1" in loops[0] and "LDS.64 1" in loops[0]


def test_must_and_per(tmp_path):
    r = run(tmp_path, "--kernel", "kernel", "--must", "FADD", "--per", "2")
    assert r.returncode == 0, r.stderr
    assert "loop 0x80-0xa0: 1.5 instructions per iteration (/2); FADD 0.5" in r.stdout
    assert "0x20-0x70" not in r.stdout


def test_no_match_is_an_error(tmp_path):
    r = run(tmp_path, "--kernel", "nothing_like_it")
    assert r.returncode != 0 and "no kernel matches nothing_like_it" in r.stderr
