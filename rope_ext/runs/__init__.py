"""What every command's run shares: its output folder and its rules (``folder``, ``results``), the models it loads
and writes (``models``), and its options as given (``specs``, ``saved``, ``values``)."""
