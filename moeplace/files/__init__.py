"""Files and safety: placement files and SGLang's file, writes that are all or nothing, and the checks of
output paths made before any work starts."""
