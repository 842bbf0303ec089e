"""Stand-in files (actors/osworld/stand_in_formats.py) open in the libraries OSWorld's getters and metrics use
(openpyxl, pandas, python-docx, python-pptx, odfpy, pypdf, PyMuPDF, soundfile, mutagen, OpenCV: the metrics env,
actors.osworld.metric_env) and in the osworld image's apps (GIMP loads the XCF, ffprobe reads the MP4)."""
from __future__ import annotations

import json
import subprocess

from actors.osworld import metric_env
from actors.osworld.stand_in_formats import MARK, stand_in

OPEN = r"""
import json, sys
import cv2, docx, fitz, mutagen, openpyxl, pandas, pptx, pypdf, soundfile
from odf.opendocument import load
d = sys.argv[1]
out = {}
wb = openpyxl.load_workbook(f"{d}/f.xlsx")
out["xlsx"] = [wb.sheetnames, wb.active["A1"].value, pandas.read_excel(f"{d}/f.xlsx", header=1).shape[0]]
out["docx"] = docx.Document(f"{d}/f.docx").paragraphs[0].text
out["pptx"] = [s.text_frame.text.splitlines()[0] for sl in pptx.Presentation(f"{d}/f.pptx").slides for s in sl.shapes]
out["odf"] = [load(f"{d}/f.{e}").mimetype.rsplit(".", 1)[1] for e in ("odt", "ods", "odp")]
out["pdf"] = [pypdf.PdfReader(f"{d}/f.pdf").pages[0].extract_text().splitlines()[0],
              fitz.open(f"{d}/f.pdf")[0].get_text().splitlines()[0]]
audio, rate = soundfile.read(f"{d}/f.mp3")
out["mp3"] = [rate, round(len(audio) / rate, 1), str(mutagen.File(f"{d}/f.mp3")["TIT2"])]
audio, rate = soundfile.read(f"{d}/f.wav")
out["wav"] = [rate, len(audio)]
cap, frames = cv2.VideoCapture(f"{d}/f.mp4"), 0
while cap.read()[0]:
    frames += 1
out["mp4"] = [frames, cap.get(cv2.CAP_PROP_FPS)]
print(json.dumps(out))
"""


def _write(folder, *exts):
    for ext in exts:
        (folder / f"f{ext}").write_bytes(stand_in(f"f{ext}", b"integration"))
    folder.chmod(0o755)


def test_stand_ins_open_in_osworlds_metric_libraries(tmp_path):
    _write(tmp_path, ".xlsx", ".docx", ".pptx", ".odt", ".ods", ".odp", ".pdf", ".mp3", ".wav", ".mp4")
    python = metric_env.ensure_env()
    proc = subprocess.run([str(python), "-c", OPEN, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["xlsx"] == [["Sheet1"], MARK, 5]  # 5 data rows under the header row
    assert got["docx"] == MARK and got["pptx"] == [MARK]
    assert got["odf"] == ["text", "spreadsheet", "presentation"]
    assert got["pdf"] == [MARK, MARK]
    assert got["mp3"] == [44100, 1.0, MARK] and got["wav"] == [16000, 16000]
    assert got["mp4"] == [10, 5.0]


def test_gimp_loads_the_xcf_and_ffprobe_reads_the_mp4_in_the_osworld_image(tmp_path, osworld_image):
    _write(tmp_path, ".xcf", ".mp4")
    for f in tmp_path.iterdir():
        f.chmod(0o644)
    load = ('(let* ((img (car (gimp-file-load RUN-NONINTERACTIVE "/si/f.xcf" "/si/f.xcf")))) '
            '(gimp-message (string-append "size " (number->string (car (gimp-image-width img))) " layers " '
            '(number->string (car (gimp-image-get-layers img))))))')
    script = (f"gimp -i -b '{load}' -b '(gimp-quit 0)' 2>&1; "
              "ffprobe -v error -show_entries stream=codec_name,width,height,nb_frames -of csv=p=0 /si/f.mp4")
    proc = subprocess.run(["docker", "run", "--rm", "--network", "none", "-v", f"{tmp_path}:/si:ro",
                           "--entrypoint", "sh", osworld_image, "-c", script],
                          capture_output=True, text=True, timeout=300)
    assert "size 64 layers 1" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "mjpeg,160,120,10" in proc.stdout, proc.stdout[-3000:]
