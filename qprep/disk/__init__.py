"""What qprep may do on the user's disk, decided here once for every command.

- `guard`: the paths a command writes are checked against every path it reads: an output is never one of the
  command's inputs, never inside an input folder, never a special file, never written through a symlink; a run
  or batch folder is never `/`, home, the current directory or a folder holding an input.
- `owned`: a folder qprep writes into is one it proved it owns: it is new or empty, or it holds a manifest a
  qprep run (or batch) wrote. Only what that manifest lists is ever removed; a refused attempt leaves nothing.
- `reading`: files qprep reads are regular files; a FIFO, device or socket is refused without blocking.
- `atomic`: every file is written whole or not at all (temp file + rename, which replaces a symlink there).
"""
