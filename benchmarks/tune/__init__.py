"""Scripts behind settings that still exist and questions still open (README.md)."""
