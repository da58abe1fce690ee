from . import markdown_table

print(markdown_table())
