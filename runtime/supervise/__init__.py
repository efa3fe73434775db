"""Starting, finding, watching and replacing the engine processes of a server: one engine per
server whatever the number of HTTP workers, none outliving the server."""
