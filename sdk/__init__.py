"""The host side of Edgepack: recipes, packager passes, artifact writer, signing, fleet tools."""
