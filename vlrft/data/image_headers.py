"""What an image file's structure may cost, checked and cut down before Pillow opens it.

Pillow's work on a file follows its pixels (bounded by `Image.MAX_IMAGE_PIXELS`), except where
the file's own structure says how much to do. Found by red-team helpers (2026-11-28):

- PNG metadata (zTXt, iTXt, iCCP): Pillow inflates each as it opens the file, up to 1 MiB, with
  no cap on ICC profiles or on text without a key; a few hundred KB inflate a gigabyte;
- a JPEG's header: Pillow walks it in Python, a byte or a segment at a time, keeping every APPn
  segment and parsing EXIF (a 1x1 JPEG whose EXIF resolution holds a million values: 2.5 s and
  330 MB per open; 47 MiB of empty markers: 14.5 s and 1.6 GB);
- a progressive JPEG's scans: each is another pass over the whole image, and a scan can be a
  few bytes (100 scans of a 16-megapixel image decode 11x slower than its baseline JPEG);
- a file's size: Pillow reads a whole PNG chunk, a whole WebP file, however large.

So an image is read as bytes, at most MAX_IMAGE_FILE_BYTES, and `sanitized` hands Pillow a copy
without what vlrft never reads (vlrft uses pixels only: no colour profile, no EXIF rotation):

- a PNG without its metadata chunks (METADATA_CHUNKS), nothing inflated but pixels; at most
  MAX_PNG_CHUNKS chunks;
- a JPEG without its APPn and COM segments (but the JFIF segment's fixed part and the Adobe
  segment: libjpeg reads its colour space from them) and without anything after its end marker
  (a motion photo's video, an MPO's further pictures); its header of at most
  MAX_JPEG_HEADER_STEPS of Pillow's steps, and at most MAX_JPEG_SCANS scans, among which only
  the markers libjpeg reads as segments (SCAN_SEGMENTS).

No library walks a JPEG's structure without doing Pillow's work (libjpeg's own walk is the
decode), so this module walks it: segment lengths and markers only, the header as Pillow's
JpegImageFile._open walks it (its MARKER table), the scans by searching for the next marker.
"""

from __future__ import annotations

import io
import re
import struct

from PIL.JpegImagePlugin import MARKER
from PIL.PngImagePlugin import ChunkStream

# Photos run to tens of MB (a 100-megapixel camera's JPEG: 40-60 MB); past this a file is refused.
MAX_IMAGE_FILE_BYTES = 64 << 20
# Encoders write 10 scans for a colour progressive JPEG (libjpeg's and mozjpeg's default
# scripts; 6 for grey), 3 or 4 for baseline with separate components. 32 keeps the worst case
# near four times a baseline decode (docs/datasets.md, "Images").
MAX_JPEG_SCANS = 32
# A camera's JPEG header, its APPn segments left out, is some 8 of Pillow's steps (SOI, two
# DQT, SOF, four DHT); each step reads at most 64 KiB.
MAX_JPEG_HEADER_STEPS = 32
MAX_JPEG_SEGMENTS = 4096  # APPn and COM segments walked past (an ICC profile takes up to 255)
MAX_JPEG_MARKERS_IN_SCANS = 1024  # tables and scans after the first scan (a progressive file: ~20)
# Encoders write image data in chunks of 8-64 KiB (libpng: 8 KiB): 8,192 chunks for a 64 MiB file.
MAX_PNG_CHUNKS = 16384
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
METADATA_CHUNKS = (b"tEXt", b"zTXt", b"iTXt", b"iCCP", b"eXIf")
JPEG_START = b"\xff\xd8\xff"
APP0, APP14, COM, SOS = 0xFFE0, 0xFFEE, 0xFFFE, 0xFFDA
JFIF_FIXED = 14  # "JFIF\0", version, units, densities, thumbnail size: the part after it is a thumbnail
# Between and within scans libjpeg reads these as segments with a length (DHT, DAC, SOS, DQT,
# DNL, DRI, APPn, COM) and restart markers (RSTn) without; any other marker there it either
# refuses or skips without a length (TEM, a restart marker resynchronised past), which a walk by
# lengths would misread: such a file is refused.
SCAN_SEGMENTS = {0xC4, 0xCC, 0xDA, 0xDB, 0xDC, 0xDD, *range(0xE0, 0xF0), 0xFE}
# In a scan's data an FF byte is followed by 00 (a stuffed FF), a restart marker (D0-D7) or FF
# (padding) unless a marker starts there.
_NEXT_MARKER = re.compile(rb"\xff[\x01-\xcf\xd8-\xfe]")
_PADDING = re.compile(rb"\xff+")


def read_image_file(fp) -> bytes:
    """The file's bytes from its start; ValueError past MAX_IMAGE_FILE_BYTES (never read whole)."""
    fp.seek(0)
    raw = fp.read(MAX_IMAGE_FILE_BYTES + 1)
    if len(raw) > MAX_IMAGE_FILE_BYTES:
        raise ValueError(f"an image file of over {MAX_IMAGE_FILE_BYTES >> 20} MiB; refused before decoding")
    return raw


def sanitized(raw: bytes) -> tuple[bytes, int]:
    """(the bytes to hand Pillow, the structure steps walked): a PNG or JPEG cut down as the
    module docstring says, anything else as it is. ValueError past a limit."""
    if raw.startswith(PNG_SIGNATURE):
        return png_without_metadata(raw)
    if raw.startswith(JPEG_START):
        return jpeg_without_metadata(raw)
    return raw, 0


def png_without_metadata(raw: bytes) -> tuple[bytes, int]:
    """`raw` (a PNG) without its METADATA_CHUNKS, and its chunk count. Chunks are read by
    Pillow's chunk reader, their data skipped; where they break off the rest is kept as it is,
    for Pillow to refuse."""
    view, fp = memoryview(raw), io.BytesIO(raw)
    fp.seek(len(PNG_SIGNATURE))
    stream, kept, end = ChunkStream(fp), [view[: len(PNG_SIGNATURE)]], len(PNG_SIGNATURE)
    for count in range(1, MAX_PNG_CHUNKS + 1):
        try:
            kind, start, length = stream.read()
        except (SyntaxError, struct.error):  # not a chunk header, or the file ends
            break
        end = min(start + length + 4, len(raw))  # its data and CRC
        if kind not in METADATA_CHUNKS:
            kept.append(view[start - 8 : end])
        if kind == b"IEND" or end == len(raw):
            return b"".join(kept), count
        fp.seek(end)
    else:
        raise ValueError(f"a PNG of more than {MAX_PNG_CHUNKS} chunks; refused before decoding")
    kept.append(view[end:])
    return b"".join(kept), count


def jpeg_without_metadata(raw: bytes) -> tuple[bytes, int]:
    """`raw` (a JPEG) without its APPn (but APP14) and COM segments and without what follows its
    end marker, and the steps walked. ValueError past MAX_JPEG_HEADER_STEPS, MAX_JPEG_SEGMENTS,
    MAX_JPEG_SCANS or MAX_JPEG_MARKERS_IN_SCANS. A structure that breaks off is kept as it is
    from there, for Pillow to refuse."""
    view = memoryview(raw)
    kept, position, steps, skipped = [view[:2]], 2, 0, 0
    while True:  # the header, as Pillow walks it (JpegImageFile._open)
        if position + 1 >= len(raw):
            return b"".join(kept) + raw[position:], steps
        if raw[position] != 0xFF:  # stray bytes, which Pillow skips one at a time: left out
            found = raw.find(b"\xff", position)
            position, steps = (found if found >= 0 else len(raw)), steps + 1
        else:
            marker = 0xFF00 | raw[position + 1]
            if marker == SOS:
                break
            if marker in MARKER and MARKER[marker][2] is not None:  # a segment: its length, then its data
                end = position + 2 + int.from_bytes(raw[position + 2 : position + 4], "big")
                if marker == APP0 and raw[position + 4 : position + 9] == b"JFIF\x00" and end >= position + 4 + JFIF_FIXED:
                    fixed = raw[position + 4 : position + 4 + JFIF_FIXED - 2] + b"\x00\x00"  # no thumbnail
                    kept.append(b"\xff\xe0" + (JFIF_FIXED + 2).to_bytes(2, "big") + fixed)
                    steps += 1
                elif 0xFFE0 <= marker <= 0xFFEF and marker != APP14 or marker == COM:
                    skipped += 1  # left out: walked past, never parsed
                    if skipped > MAX_JPEG_SEGMENTS:
                        raise ValueError(f"a JPEG of more than {MAX_JPEG_SEGMENTS} APPn and COM segments; "
                                         "refused before decoding")
                else:
                    kept.append(view[position:end])
                    steps += 1
                position = max(end, position + 2)
            elif marker == 0xFFFF:  # padding, left out: the last FF of the run starts the next marker
                position, steps = _PADDING.match(raw, position).end() - 1, steps + 1
            else:  # a marker without data, FF 00, or no marker: what Pillow skips or refuses
                kept.append(view[position : position + 2])
                position, steps = position + 2, steps + 1
        if steps > MAX_JPEG_HEADER_STEPS:
            raise ValueError(f"a JPEG whose header takes more than {MAX_JPEG_HEADER_STEPS} segments, markers or "
                             "padding bytes before its first scan; refused before decoding")
    start, scans, markers = position, 0, 0  # the scans: each SOS, the tables between them, up to EOI
    while True:
        if raw[position + 1] == 0xD9:  # EOI: the image ends here
            return b"".join(kept) + raw[start : position + 2], steps + markers
        if raw[position + 1] not in SCAN_SEGMENTS:
            raise ValueError(f"a JPEG with marker FF{raw[position + 1]:02X} among its scans, which libjpeg does not "
                             "read as a segment; refused before decoding")
        markers += 1
        scans += raw[position + 1] == 0xDA
        if scans > MAX_JPEG_SCANS:
            raise ValueError(f"a JPEG of more than {MAX_JPEG_SCANS} scans, each a pass over the whole image; "
                             "refused before decoding")
        if markers > MAX_JPEG_MARKERS_IN_SCANS:
            raise ValueError(f"a JPEG of more than {MAX_JPEG_MARKERS_IN_SCANS} markers among its scans; "
                             "refused before decoding")
        after = position + 2 + int.from_bytes(raw[position + 2 : position + 4], "big")  # the segment, then data
        found = _NEXT_MARKER.search(raw, max(after, position + 2))
        if found is None:  # cut off before its end marker: libjpeg says so
            return b"".join(kept) + raw[start:], steps + markers
        position = found.start()
